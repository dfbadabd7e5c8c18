"""Config composition (no process launched) and validation messages."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from ckptless_hpc.config import ConfigError, fault_list, register_configs, validate, validation_errors

pytestmark = pytest.mark.timeout(30)
register_configs()


def cfg(*overrides: str):
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_are_valid_and_named_as_documented():
    c = cfg()
    validate(c)
    assert c.cluster.backend == "local" and c.task._target_.endswith("LMTask") and c.fault.kind == "none"
    for key in ("train.steps", "train.seed", "cluster.nodes", "cluster.workers_per_node", "cluster.spare_nodes"):
        section, name = key.split(".")
        assert name in c[section]


def test_slurm_group_switches_schema():
    c = cfg("cluster=slurm", "cluster.partition=debug", "cluster.time_min=5")
    validate(c)
    assert c.cluster.backend == "slurm" and c.cluster.partition == "debug"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("cluster.nodes=0", "cluster.nodes=0: must be >= 1"),
        ("cluster.spare_nodes=-2", "cluster.spare_nodes=-2"),
        ("cluster.workers_per_node=0", "cluster.workers_per_node=0"),
        ("train.steps=0", "train.steps=0"),
        ("cluster.heartbeat_timeout_s=0.1", "cluster.heartbeat_timeout_s=0.1"),
        ("cluster.heartbeat_timeout_s=inf", "cluster.heartbeat_timeout_s=inf: must be at most 3600 s: a larger value turns hang detection off"),
        ("cluster.heartbeat_timeout_s=1e12", "cluster.heartbeat_timeout_s=1000000000000.0: must be at most 3600 s"),
        ("cluster.recovery_timeout_s=inf", "cluster.recovery_timeout_s=inf: must be a finite number > 0"),
        ("train.max_skipped_fraction=1.5", "train.max_skipped_fraction=1.5: must be in [0, 1]"),
        ("train.max_skipped_fraction=-0.1", "train.max_skipped_fraction=-0.1: must be in [0, 1]"),
        ("optim.lr=-1", "optim.lr=-1"),
        ("train.console_rank=2", "train.console_rank=2: must be a rank of the job (0..1) or null"),
        ("train.grad_accum=0", "train.grad_accum=0: must be an integer >= 1"),
        ("train.clip_grad_norm=-1", "train.clip_grad_norm=-1.0: must be > 0 or null"),
        ("train.precision=fp8", "train.precision='fp8': unknown precision"),
        ("train.on_nonfinite=ignore", "train.on_nonfinite='ignore': unknown policy"),
        ("train.data_workers=-1", "train.data_workers=-1: must be an integer >= 0"),
        ("train.prefetch=0", "train.prefetch=0: must be an integer >= 1"),
        ("train.bucket_mb=0", "train.bucket_mb=0.0: must be > 0"),
        ("train.stall_timeout_s=0", "train.stall_timeout_s=0.0: must be > 0 or null"),
        ("train.compile_backend=tvm", "train.compile_backend='tvm': unknown backend"),
        ("parallel.param_dtype=bf16", "parallel.param_dtype='bf16': FSDP2's MixedPrecisionPolicy is for parallel=fsdp|hsdp and tp x shard (parallel.shard_size > 1), not ddp"),
        ("parallel.reduce_dtype=int8", "parallel.reduce_dtype='int8': unknown dtype"),
    ],
)
def test_each_bad_value_is_named_with_a_hint(override, needle):
    errors = validation_errors(cfg(override))
    assert len(errors) == 1 and errors[0].startswith(needle) and "HINT" in errors[0], errors


def test_fault_validation():
    assert "no such rank" in validation_errors(cfg("fault=kill_worker", "fault.rank=2"))[0]
    assert "fault.node=5" in validation_errors(cfg("fault=kill_node", "fault.node=5"))[0]
    assert "fault.step=100" in validation_errors(cfg("fault=hang", "fault.step=100", "train.steps=100"))[0]
    errs = validation_errors(cfg("fault.schedule=[{kind:explode,rank:0,step:3}]"))
    assert errs[0].startswith("fault.schedule[0].kind='explode'")
    with pytest.raises(ConfigError):
        validate(cfg("cluster.nodes=0"))


def test_fault_moment_is_refused_where_the_kind_has_a_fixed_one():
    (err,) = validation_errors(cfg("fault=slow", "fault.at=recovery"))
    assert err.startswith("fault.at='recovery': a slow fault always strikes 'step'") and "HINT" in err
    (err,) = validation_errors(cfg("fault=corrupt_transfer", "fault.at=receive"))
    assert "a corrupt_transfer fault strikes a state being served" in err and "fault.at=optimizer" in err
    assert not validation_errors(cfg("fault=corrupt_transfer", "fault.at=send"))
    assert not validation_errors(cfg("fault=corrupt_transfer", "fault.at=optimizer"))
    assert not validation_errors(cfg("fault=truncate_transfer"))
    assert not validation_errors(cfg("fault=kill_worker", "fault.rank=1", "fault.at=receive"))


def test_fault_list_form():
    c = cfg("fault=kill_worker", "fault.step=5", "fault.schedule=[{kind:kill_node,node:0,step:9},{kind:hang,rank:0,step:12}]")
    assert [(f["kind"], f["step"]) for f in fault_list(c.fault)] == [("kill_worker", 5), ("kill_node", 9), ("hang", 12)]
    assert not validation_errors(c)


def test_unknown_key_is_rejected():
    with pytest.raises(Exception, match="stpes"):
        cfg("train.stpes=3")


def test_fetch_parallel_must_be_a_positive_integer():
    (err,) = validation_errors(cfg("cluster.fetch_parallel=0"))
    assert err.startswith("cluster.fetch_parallel=0: must be an integer >= 1") and "HINT" in err


def test_the_shape_is_derived_once_from_the_cluster():
    from ckptless_hpc.config import Shape

    s = Shape.of(cfg("cluster.nodes=3", "cluster.workers_per_node=4", "cluster.spare_nodes=2"))
    assert (s.nodes, s.workers_per_node, s.spare_nodes, s.world) == (3, 4, 2, 12)
    assert [s.node_of(r) for r in (0, 3, 4, 11)] == [0, 0, 1, 2] and s.ranks_of(1) == [4, 5, 6, 7]
    assert Shape.of(cfg().cluster) == Shape.of(cfg())  # the section or the whole config
    assert Shape.of(cfg("cluster.nodes=0")).world == 0  # never raises: validate reports the value


def test_min_nodes_and_the_reduction_are_checked_and_say_what_the_job_survives():
    from ckptless_hpc.config import node_losses, reduction

    for overrides, needle in (
        (("cluster.nodes=3", "cluster.min_nodes=4"), "cluster.min_nodes=4: must be an integer in 1..cluster.nodes=3"),
        (("cluster.nodes=3", "cluster.min_nodes=0"), "cluster.min_nodes=0: must be an integer in 1..cluster.nodes=3"),
        (("cluster.nodes=3", "cluster.min_nodes=2", "parallel=hsdp", "parallel.shard_size=1"), "parallel.mode=hsdp cannot shrink yet"),
        (("cluster.nodes=3", "cluster.min_nodes=2", "parallel=fsdp"), "parallel.mode=fsdp cannot shrink yet"),
        (("cluster.nodes=3", "cluster.min_nodes=2", "train.reduction=allreduce"), "needs the fixed-order reduction"),
        (("train.reduction=ring",), "train.reduction='ring': unknown reduction. HINT: use one of auto, allreduce, fixed"),
        (("cluster.nodes=3", "cluster.start_nodes=2"), "cluster.start_nodes=2: must be an integer in cluster.min_nodes..cluster.nodes (3..3), or null"),
        (("cluster.nodes=3", "cluster.min_nodes=2", "cluster.start_nodes=4"), "cluster.start_nodes=4: must be an integer in cluster.min_nodes..cluster.nodes (2..3)"),
        (("cluster.grow=queue",), "cluster.grow='queue': unknown source of replacement nodes. HINT: use one of allocation, job"),
        (("cluster.grow=job",), "cluster.grow='job': a companion job of replacement nodes is a Slurm job. HINT: use cluster=slurm"),
    ):
        errors = validation_errors(cfg("task=mlp", *overrides))
        assert any(needle in e and "HINT" in e for e in errors), (overrides, errors)
    elastic = cfg("task=mlp", "cluster.nodes=3", "cluster.spare_nodes=1", "cluster.min_nodes=2")
    validate(elastic)
    assert reduction(elastic) == "fixed" and reduction(cfg("task=mlp")) == "allreduce"
    assert reduction(cfg("task=mlp", "train.reduction=fixed")) == "fixed"
    assert reduction(cfg("task=mlp", "cluster.min_nodes=2")) == "allreduce"  # min_nodes = nodes: never shrinks
    assert "survives 1 node loss with spares (and up to 4 refilled), then shrinks to 2 of 3 nodes" in node_losses(elastic)
    assert "the next one stops the job" in node_losses(cfg("task=mlp", "cluster.spare_nodes=0", "cluster.refill_spares=false"))
    late = cfg("task=mlp", "cluster.nodes=3", "cluster.min_nodes=2", "cluster.start_nodes=2")
    validate(late)
    assert node_losses(late).startswith("starts on 2 of 3 nodes (cluster.start_nodes) and grows when nodes come; node losses:")
