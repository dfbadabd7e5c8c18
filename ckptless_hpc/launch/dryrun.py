"""``dry_run=true``: the whole config validated, the task checked (its class imported, the
arguments matched against its signature: :mod:`.task_check`; no model built), the placement and
(Slurm) the rendered sbatch/srun lines printed; nothing is launched."""

from __future__ import annotations

import shlex
import sys
from typing import Any, List

from ..config import Shape, node_losses
from ..rundir import paths

EXIT_TASK = 2  # as any other invalid configuration


def placement(cfg: Any) -> List[str]:
    c, shape = cfg.cluster, Shape.of(cfg)
    name = (lambda i: f"local{i}") if c.backend == "local" else (lambda i: f"<node {i + 1}>")
    lines = [f"placement: {shape.nodes} worker node(s) x {shape.workers_per_node} rank(s) = world size {shape.world}; {shape.spare_nodes} hot-spare node(s)"]
    for n in range(shape.nodes):
        lines.append(f"  {name(n):<10} ranks {shape.ranks_of(n)}")
    for s in range(shape.spare_nodes):
        lines.append(f"  {name(shape.nodes + s):<10} spare ({shape.workers_per_node} hot-spare worker(s): model built, waiting for a rank)")
    from ..coordinator.sharding import Layout

    layout = Layout(cfg)
    if not layout.sharded:
        lines.append("replicas: data parallel, every rank holds the full model and optimizer state; any healthy rank is a state source")
    else:
        lines.append(f"state: {layout.describe()}")
        if layout.mode in ("tp", "pp"):
            if layout.pp_shard > 1:  # a coordinate is (pipeline, stage[, TP rank]): a pipeline's ranks inside
                lines += mesh_lines(shape, int(layout.shard_size), lambda r: name(shape.node_of(r)), "pp_shard", layout.pp * layout.tp, layout.tp)
            else:
                inner = int(cfg.parallel.get("tp") or 1) if layout.mode == "pp" or layout.tp_shard > 1 else 1
                lines += mesh_lines(shape, int(layout.shard_size or 1), lambda r: name(shape.node_of(r)), layout.mode, inner)
        holders = layout.place({r: name(shape.node_of(r)) for r in range(shape.world)})
        for owner, hs in sorted(holders.items()):
            if hs:
                lines.append(f"  rank {owner}'s shard copied to rank(s) {hs}")
    lines.append(node_losses(cfg))
    return lines


def mesh_lines(shape: Any, tp: int, node_of: Any, mode: str = "tp", stage_tp: int = 1, pipe_tp: int = 1) -> List[str]:
    """The tensor-parallel mesh (replicas x tp), the pipelines (replicas x pp stages) or, with
    ``stage_tp`` > 1, the pipelines of TP groups (pp x tp: replicas x pp x tp), the TP groups
    FSDP2 shards over (tp x shard: replicas x dp_shard x tp) or the pipelines FSDP2 shards each
    stage over (``mode="pp_shard"``: replicas x dp_shard x pp (x tp ``pipe_tp``), ``stage_tp`` a pipeline's ranks), ``tp``
    then a replica's ranks: each coordinate's rank and node, and each coordinate's replicas,
    which hold its shard (the copies that survive a node)."""
    replicas = shape.world // tp
    coord, title, c_ = ("TP coordinate", "TP coordinate", "c") if mode == "tp" else ("stage", "Stage", "s")
    if mode == "pp_shard":  # a coordinate is (FSDP shard = pipeline, stage[, TP rank])
        dims, rank_of = f"pp {stage_tp // pipe_tp}", f"d*{stage_tp}+s"
        if pipe_tp > 1:
            dims, rank_of = f"{dims} x tp {pipe_tp}", f"d*{stage_tp}+s*{pipe_tp}+t"
        what = "stage s, TP rank t" if pipe_tp > 1 else "stage s"
        out = [f"mesh: {replicas} replica(s) x dp_shard {tp // stage_tp} x {dims} (replica r, FSDP shard d (a pipeline), {what} = rank r*{tp}+{rank_of})"]
        labels = names = [f"d{c // stage_tp}s{c % stage_tp // pipe_tp}" + (f"t{c % pipe_tp}" if pipe_tp > 1 else "") for c in range(tp)]
        title = "Coordinate"
    elif stage_tp > 1:  # a coordinate is (stage or FSDP shard, TP rank)
        dim, what = ("pp", "stage") if mode == "pp" else ("dp_shard", "FSDP shard")
        out = [f"mesh: {replicas} replica(s) x {dim} {tp // stage_tp} x tp {stage_tp} (replica r, {what} s, TP rank t = rank r*{tp}+s*{stage_tp}+t)"]
        labels = names = [f"s{c // stage_tp}t{c % stage_tp}" for c in range(tp)]
        title = "Coordinate"
    else:
        out = [f"mesh: {replicas} replica(s) x {mode} {tp} (replica r, {coord} {c_} = rank r*{tp}+{c_})"]
        labels, names = [f"{c_}{c}" for c in range(tp)], [str(c) for c in range(tp)]
    for r in range(replicas):
        out.append(f"  replica {r}: " + ", ".join(f"{labels[c]}=rank {r * tp + c}@{node_of(r * tp + c)}" for c in range(tp)))
    for c in range(tp):
        nodes = sorted({node_of(r * tp + c) for r in range(replicas)})
        out.append(f"  {title} {names[c]}: held by {replicas} replica(s) on {len(nodes)} node(s) ({', '.join(nodes)})")
    return out


def slurm_lines(cfg: Any, run_dir: str) -> List[str]:
    from ..slurm import render
    from .slurm import node_step_argv, shape_from_config

    shape = shape_from_config(cfg, run_dir)
    srun = node_step_argv(cfg, "NODE", cfg.cluster.workers_per_node, "BATCHHOST:PORT", None, f"{run_dir}/{paths.LOGS}/NODE.%t.log")
    return [
        "sbatch (the coordinator's job, submitted through submitit):",
        *("  " + line for line in render.sbatch_header(shape)),
        "srun, one step per worker node and per spare node (launched by the coordinator inside the allocation):",
        "  " + shlex.join(srun).replace("NODE", "<node>").replace("BATCHHOST:PORT", "<batch host>:<port>"),
    ]


def dry_run(cfg: Any, run_dir: str) -> int:
    from ..config import global_batch
    from ..faults import faults_from_config
    from .task_check import batch_size, task_errors

    errors = task_errors(cfg.get("task"))
    if errors:
        print("ckptless_hpc: invalid configuration:\n  - " + "\n  - ".join(errors), file=sys.stderr)
        return EXIT_TASK
    print(f"dry run: configuration valid (cluster={cfg.cluster.backend}, task={cfg.task._target_}, {cfg.train.steps} steps); nothing launched")
    print(global_batch(cfg, batch_size(cfg)))
    for line in placement(cfg):
        print(line)
    for f in faults_from_config(cfg):
        print(f"fault {f.index}: {f.describe()}")
    if cfg.cluster.backend == "slurm":
        for line in slurm_lines(cfg, run_dir):
            print(line)
    return 0
