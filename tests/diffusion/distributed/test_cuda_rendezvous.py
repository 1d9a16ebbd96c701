"""Two CUDA diffusion ranks meet through `init_diffusion_distributed`'s TCP store, which rank 0 binds to the init
method's address itself (c10d's own listens on `[::]`), and form their NCCL world: one all-reduce is exact and the
store listens on 127.0.0.1 only (NCCL's own bootstrap sockets are NCCL's business). Needs two GPUs (the CPU path,
gloo, is covered by tests/diffusion/test_dlo.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


def _rank_main(rank: int, port: int) -> None:
    import psutil

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import destroy_diffusion_distributed, init_diffusion_distributed

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    init_diffusion_distributed(rank=rank, world_size=2, parallel_config=DiffusionParallelConfig(cfg_parallel_size=2),
                               device=device, distributed_init_method=f"tcp://127.0.0.1:{port}")
    try:
        assert torch.distributed.get_backend() == "nccl"
        t = torch.full((4,), rank + 1.0, device=device)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [3.0] * 4, t
        store = {s.laddr.ip for s in psutil.Process().net_connections(kind="inet")
                 if s.status == psutil.CONN_LISTEN and s.laddr.port == port}
        assert store == ({"127.0.0.1"} if rank == 0 else set()), store
    finally:
        destroy_diffusion_distributed()


def test_two_nccl_ranks_meet_on_the_loopback_store():
    import torch.multiprocessing as mp
    from vllm.utils.network_utils import get_open_port

    mp.spawn(_rank_main, args=(get_open_port(),), nprocs=2, join=True)
