"""The GPU path's pure logic, on CPU (fakes stand in for NCCL where noted): the environment
block, device and backend choice, the GPU mapping and its refusal, which CUDA errors poison a
process, and the bounded release of a generation's communicator."""

from __future__ import annotations

import threading

import pytest
from hydra import compose, initialize_config_module

from ckptless_hpc.config import register_configs, validation_errors
from ckptless_hpc.train import cuda
from ckptless_hpc.train.comm import Communicator, DeadlineExceeded, within

pytestmark = pytest.mark.timeout(30)
register_configs()


def test_environment_block_sets_what_is_missing_and_reports_conflicts():
    to_set, conflicts = cuda.nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "PATH": "/bin"})
    assert to_set["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and to_set["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in to_set  # already what is needed
    assert to_set["NCCL_ALGO"] == "Ring" and to_set["NCCL_PROTO"] == "Simple" and to_set["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    (line,) = conflicts
    assert line.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=3 replaced by 0: ")
    relaxed, _ = cuda.nccl_environment({}, deterministic=False)
    assert "NCCL_ALGO" not in relaxed and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in relaxed


def test_device_and_backend_choice():
    assert cuda.resolve_device("auto", "auto", cuda_available=False) == ("cpu", "gloo")
    assert cuda.resolve_device("auto", "auto", cuda_available=True) == ("cuda", "nccl")
    assert cuda.resolve_device("auto", "auto", cuda_available=True, cluster_backend="local") == ("cuda", "gloo")  # nodes share the machine
    assert cuda.resolve_device("cuda", "gloo", cuda_available=True) == ("cuda", "gloo")
    with pytest.raises(ValueError, match="sees no CUDA device.*HINT"):
        cuda.resolve_device("cuda", "auto", cuda_available=False)
    with pytest.raises(ValueError, match="nccl needs cluster.device=cuda.*HINT"):
        cuda.resolve_device("cpu", "nccl", cuda_available=True)


def test_one_nccl_rank_per_gpu_local_rank_mapping():
    assert [cuda.cuda_index(i, 4, 4, "nccl") for i in range(4)] == [0, 1, 2, 3]
    assert [cuda.cuda_index(i, 4, 2, "gloo") for i in range(4)] == [0, 1, 0, 1]  # gloo may share
    with pytest.raises(ValueError, match="puts 2 NCCL ranks on 1 GPU.*HINT: set cluster.workers_per_node=1"):
        cuda.cuda_index(1, 2, 1, "nccl")


def test_the_config_refuses_two_nccl_ranks_on_one_gpu():
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        bad = compose(config_name="config", overrides=["cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.workers_per_node=2"])
        shared = compose(config_name="config", overrides=["cluster.device=cuda", "cluster.comm=gloo", "cluster.gpus_per_node=1", "cluster.workers_per_node=2"])
        cpu_nccl = compose(config_name="config", overrides=["cluster.device=cpu", "cluster.comm=nccl"])
        local_nccl = compose(config_name="config", overrides=["cluster.device=cuda", "cluster.comm=nccl", "cluster.nodes=2"])
        one_node = compose(config_name="config", overrides=["cluster.device=cuda", "cluster.comm=nccl", "cluster.nodes=1", "cluster.workers_per_node=4"])
    (err,) = validation_errors(bad)
    assert err.startswith("cluster.workers_per_node=2: puts 2 NCCL ranks on cluster.gpus_per_node=1 GPUs") and "HINT" in err
    assert not validation_errors(shared)
    assert validation_errors(cpu_nccl)[0].startswith("cluster.comm='nccl': nccl needs CUDA devices")
    assert "would share GPUs" in validation_errors(local_nccl)[0] and not validation_errors(one_node)


@pytest.mark.parametrize(
    "message, poisons",
    [
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA error: device-side assert triggered", True),
        ("uncorrectable ECC error encountered", True),
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer", False),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ],
)
def test_which_cuda_errors_poison_the_process(message, poisons):
    assert cuda.poisons_context(RuntimeError(message)) is poisons


def test_within_returns_raises_or_gives_up():
    assert within(lambda: 7, 1.0, "quick") == 7
    with pytest.raises(KeyError):
        within(lambda: {}["x"], 1.0, "failing")
    release = threading.Event()
    with pytest.raises(DeadlineExceeded, match="stuck did not return within 0.2s"):
        within(release.wait, 0.2, "stuck")
    release.set()


class _FakeNCCL:
    """Stands in for ProcessGroupNCCL.abort (pure logic: no GPU here)."""

    def __init__(self, hang: bool) -> None:
        self.hang, self.aborts = hang, 0
        self.gate = threading.Event()

    def abort(self) -> None:
        self.aborts += 1
        if self.hang:
            self.gate.wait()


def test_an_nccl_communicator_is_aborted_once_within_the_deadline():
    pg = _FakeNCCL(hang=False)
    comm = Communicator(pg, gen=3, rank=0, world=2, backend="nccl")
    comm.release(1.0)
    comm.release(1.0)
    assert pg.aborts == 1 and comm.aborted


def test_an_abort_that_does_not_return_makes_the_process_lost():
    pg = _FakeNCCL(hang=True)
    with pytest.raises(DeadlineExceeded, match="NCCL abort of generation 5 did not return"):
        Communicator(pg, gen=5, rank=1, world=2, backend="nccl").release(0.2)
    pg.gate.set()


def test_a_gloo_group_is_abandoned_not_aborted():
    pg = _FakeNCCL(hang=True)
    Communicator(pg, gen=1, rank=0, world=2, backend="gloo").release(0.2)
    assert pg.aborts == 0


class _RecordingCopies:
    """Stands in for the CUDA side stream (pure logic): copies at once, and fails the test if a
    slot is overwritten while the consumer may still be sending or hashing it."""

    def __init__(self, chunk: int, depth: int) -> None:
        import torch

        self.slots = [torch.empty(chunk, dtype=torch.uint8) for _ in range(depth)]
        self.in_use: list = []  # slots of the last two slices handed out (sent, hashed)

    def start(self, slot, src):
        assert slot not in self.in_use, f"slot {slot} reused while its bytes are still being sent or hashed"
        self.slots[slot][: src.numel()].copy_(src)
        return slot

    def finish(self, slot, n, token):
        self.in_use = (self.in_use + [slot])[-2:]
        return memoryview(self.slots[slot][:n].numpy()).cast("B")


def test_staging_ring_keeps_order_and_never_reuses_a_slot_in_use():
    import torch

    from ckptless_hpc.state.snapshot import byte_view
    from ckptless_hpc.state.staging import host_slices

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=g), torch.arange(7, dtype=torch.int64), torch.randn(3, 333, generator=g), torch.empty(0)]
    staged = {0, 2}  # entries 0 and 2 "live on the device"; 1 and 3 on the host, in between
    copies = _RecordingCopies(chunk=512, depth=4)
    out = {}
    for i, off, part in host_slices(tensors, 512, depth=4, copies=copies, staged=lambda t: any(t is tensors[k] for k in staged)):
        out.setdefault(i, bytearray()).extend(bytes(part))
        assert len(part) <= 512
    assert [i for i in out] == [0, 1, 2]  # in order (the empty tensor has no bytes)
    for i in (0, 1, 2):
        assert bytes(out[i]) == bytes(byte_view(tensors[i]))
    with pytest.raises(ValueError, match="at least 3 slots"):
        list(host_slices(tensors, 512, depth=2))
