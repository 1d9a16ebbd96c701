"""Set up torch.distributed, vLLM's model-parallel groups and the diffusion groups for one diffusion worker.

Every worker gets a process group even when it is alone (gloo on CPU, nccl on CUDA), so a pipeline
written with vLLM's `ColumnParallelLinear` / `RowParallelLinear` runs unchanged at any tensor-parallel
size. Tests call `init_diffusion_distributed` in-process with world_size 1.

Rank layout (innermost first): tensor parallel, Ulysses, ring, AllGather-KV, CFG, denoise copy:
`rank = ((((copy * cfg_size + cfg) * allgather_degree + allgather) * ring_degree + ring) * ulysses_degree
+ ulysses) * tp + tp_rank` (ring and AllGather-KV are never both above 1); there is
more than one copy of the denoise loop only when `vae_patch_parallel_size` exceeds TP x SP x CFG. VAE patch
groups are runs of `vae_patch_parallel_size` consecutive ranks (they decode after the loop, so they reuse its
ranks). vLLM builds the TP groups
over consecutive ranks (the rest of the world is its "external data parallel" dimension); we build the
Ulysses, ring, sequence-parallel (ring x Ulysses) and CFG groups as vLLM `GroupCoordinator`s, once, at start-up.
As vLLM's own `_TP`, they live in this module for the life of the worker process.

Why module-level and not on the worker / runner: the model code that uses them (vLLM's parallel linears inside
the transformers, our attention layer, `sequence.py`'s shard / gather, the VAE patch decode) already reads vLLM's
groups from `vllm.distributed.parallel_state`, the same way; passing ours explicitly would mean threading a groups
object through every pipeline, transformer and attention constructor while TP still came from vLLM's module, so
the two would be owned in two different ways. One worker process is one rank of one stage, so there is exactly one
set of groups per process; `init_diffusion_distributed` sets it once and `destroy_diffusion_distributed` clears it.
"""

from __future__ import annotations

import math
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.config import VllmConfig
    from vllm.distributed.parallel_state import GroupCoordinator

    from vllm_omni.diffusion.data import DiffusionParallelConfig


@dataclass(frozen=True)
class DiffusionParallelGroups:
    """The groups a diffusion rank belongs to besides vLLM's TP group."""

    ulysses: GroupCoordinator
    """Ranks that exchange heads for sequence (all-to-all)."""
    ring: GroupCoordinator
    """Ranks that pass K/V blocks around (ring attention)."""
    allgather: GroupCoordinator
    """Ranks that all-gather each other's K/V shards (AllGather-KV attention)."""
    sp: GroupCoordinator
    """allgather x ring x ulysses: the ranks that each hold one shard of the image/video sequence (outer
    dimension major)."""
    cfg: GroupCoordinator
    """Ranks that run the positive (CFG rank 0) and the negative (CFG rank 1) branch."""
    vae: GroupCoordinator
    """Ranks that each decode one row strip of the latents (VAE patch parallel)."""
    failures: ProcessGroup
    """Every rank, gloo, with twice `distributed_timeout_seconds`: the ranks compare failures over it
    (`rank_errors.py`), and a rank that failed must still be waiting when a peer's collective times out."""
    ulysses_mode: str = "strict"
    """How the Ulysses all-to-all treats heads its degree does not divide (`ulysses_mode`)."""


_GROUPS: DiffusionParallelGroups | None = None


def make_vllm_config(parallel_config: DiffusionParallelConfig) -> VllmConfig:
    """The VllmConfig vLLM's layers and group setup read as "current" (parallel sizes only)."""
    from vllm.config import ParallelConfig, VllmConfig

    timeout = parallel_config.distributed_timeout_seconds
    return VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=parallel_config.tensor_parallel_size,
                                                     distributed_timeout_seconds=timeout,
                                                     cpu_distributed_timeout_seconds=timeout))


def group_ranks(parallel_config: DiffusionParallelConfig) -> dict[str, list[list[int]]]:
    """Global ranks of every Ulysses / ring / sp / CFG group, from the rank layout in the module doc."""
    pc = parallel_config
    world = torch.arange(pc.world_size)
    grid = world.reshape(-1, pc.cfg_parallel_size, pc.allgather_degree, pc.ring_degree, pc.ulysses_degree,
                         pc.tensor_parallel_size)

    def along(*dims: int) -> list[list[int]]:
        rest = [d for d in range(grid.dim()) if d not in dims]
        return grid.permute(*rest, *dims).reshape(-1, math.prod(grid.shape[d] for d in dims)).tolist()

    return {"ulysses": along(4), "ring": along(3), "allgather": along(2), "sp": along(2, 3, 4), "cfg": along(1),
            "vae": world.reshape(-1, pc.vae_patch_parallel_size).tolist()}


def init_diffusion_distributed(
    *,
    rank: int,
    world_size: int,
    parallel_config: DiffusionParallelConfig,
    device: torch.device,
    distributed_init_method: str | None = None,
    listen_socket: socket.socket | None = None,
) -> VllmConfig:
    """Initialize the world group, vLLM's TP/PP groups and ours; returns the VllmConfig to keep current.

    `listen_socket`: rank 0's store socket, already bound to the init method's port by whoever chose the port
    (see `rendezvous_store`)."""
    global _GROUPS
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import get_world_group, init_model_parallel_group
    from vllm.platforms import current_platform

    if parallel_config.world_size != world_size:
        raise ValueError(f"parallel config needs {parallel_config.world_size} ranks, got world_size={world_size}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=parallel_config.distributed_timeout_seconds)
    if distributed_init_method is None:
        if world_size > 1:
            raise ValueError("distributed_init_method is required for more than one rank")
        # One rank meets nobody: an in-memory store, not a TCP rendezvous (c10d's TCPStore listens on every
        # interface, whatever host the init method names). vLLM keeps the world it finds initialized.
        torch.distributed.init_process_group(
            backend, store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        distributed_init_method, ident = "env://", f"pid{os.getpid()}"
    elif distributed_init_method.startswith("file://"):
        ident = os.path.basename(distributed_init_method.removeprefix("file://"))
    else:
        ident = distributed_init_method.rsplit(":", 1)[-1]
        torch.distributed.init_process_group(
            backend, store=rendezvous_store(distributed_init_method, rank, world_size, timeout, listen_socket),
            rank=rank,
            world_size=world_size, timeout=timeout)
        distributed_init_method = "env://"
    if device.type == "cpu":  # names the shared-memory TP communicator of vLLM CPU, as vLLM's CPU worker does
        os.environ["VLLM_DIST_IDENT"] = ident
    local_rank = (device.index or 0) if device.type == "cuda" else rank
    # vLLM's CPU TP communicator makes a collective only when its kernels are loaded: load them on every rank
    # first, or a rank that has not loaded them yet skips a collective its peers make (a hang).
    current_platform.import_kernels()
    vllm_config = make_vllm_config(parallel_config)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            distributed_init_method=distributed_init_method,
            local_rank=local_rank,
            backend=backend,
            timeout=timeout,
        )
        initialize_model_parallel(tensor_model_parallel_size=parallel_config.tensor_parallel_size)
        local = get_world_group().local_rank
        _GROUPS = DiffusionParallelGroups(**{
            name: init_model_parallel_group(ranks, local, backend, group_name=f"diffusion_{name}")
            for name, ranks in group_ranks(parallel_config).items()
        }, failures=torch.distributed.new_group(
            backend="gloo", timeout=timedelta(seconds=2 * parallel_config.distributed_timeout_seconds)),
            ulysses_mode=parallel_config.ulysses_mode)
    return vllm_config


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: timedelta,
                     listen_socket: socket.socket | None = None) -> torch.distributed.Store:
    """The world's TCP store at `tcp://host:port`, served by rank 0 on `host` only (the loopback address on one
    host, the node's address across nodes): c10d's TCPStore, given just the init method, listens on every
    interface (`[::]`), so rank 0 binds the listening socket itself and the store takes it over. A launcher that
    binds the socket when it picks the port (`listen_socket`) closes the window in which another process on the
    host could take a port found free."""
    from vllm.distributed.utils import create_tcp_store
    from vllm.utils.network_utils import is_valid_ipv6_address, split_host_port

    host, port = split_host_port(init_method.removeprefix("tcp://"))
    if rank == 0 and listen_socket is None:
        family = socket.AF_INET6 if is_valid_ipv6_address(host) else socket.AF_INET
        listen_socket = socket.create_server((host, port), family=family)
    return create_tcp_store(host, port, listen_socket=listen_socket, world_size=world_size, is_master=rank == 0,
                            timeout=timeout, wait_for_workers=False)


def get_diffusion_groups() -> DiffusionParallelGroups | None:
    """This worker's groups; None when `init_diffusion_distributed` has not run (a model used standalone)."""
    return _GROUPS


def sequence_parallel_size() -> int:
    return 1 if _GROUPS is None else _GROUPS.sp.world_size


def shared_random_seed() -> int:
    """A random seed every rank agrees on (all ranks of a stage must draw the same noise)."""
    from vllm.distributed.parallel_state import get_world_group, model_parallel_is_initialized

    seed = random.getrandbits(63)
    if model_parallel_is_initialized() and get_world_group().world_size > 1:
        seed = get_world_group().broadcast_object(seed, src=0)
    return seed


def destroy_diffusion_distributed() -> None:
    global _GROUPS
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    if _GROUPS is not None:
        from vllm.distributed.parallel_state import GroupCoordinator

        torch.distributed.destroy_process_group(_GROUPS.failures)
        for group in vars(_GROUPS).values():
            if isinstance(group, GroupCoordinator):
                group.destroy()
        _GROUPS = None
    destroy_model_parallel()
    destroy_distributed_environment()
