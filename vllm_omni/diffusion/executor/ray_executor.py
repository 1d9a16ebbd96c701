"""Diffusion worker ranks as Ray actors in one placement group: the executor of `--worker-backend ray`.

The ranks run the mp executor's worker loop (`WorkerProc`) and speak its msgspec messages over its ZeroMQ
sockets, bound on this node's address instead of IPC files, with every tensor inline (a rank may be on another
node, where this host's shared memory is not). What Ray adds is where and how long: one placement-group bundle
per rank (the stage's `placement` resources plus a device or a CPU; STRICT_PACK keeps the ranks' collectives
on one node), actors that die with the process that made them, and a rank's `run` call that ends when its actor
does, which the base class's monitor waits on as it waits on a process sentinel.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

from vllm_omni.diffusion.data import OmniDiffusionConfig, RayPlacement, resolve_device_kind
from vllm_omni.diffusion.executor.multiproc_executor import _SHUTDOWN_TIMEOUT_S, MultiprocDiffusionExecutor
from vllm_omni.diffusion.executor.ray_cluster import connect
from vllm_omni.diffusion.worker.worker_proc import WorkerProc, WorkerSpec
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import configure_process_logging, init_logger

logger = init_logger(__name__)

_RANK_WATCH_POLL_S = 1.0
_CALL_TIMEOUT_S = 60.0


def rank_bundle(od_config: OmniDiffusionConfig) -> dict[str, float]:
    """What one rank reserves: a GPU on CUDA, a CPU otherwise, and the stage's placement resources."""
    device = {"GPU": 1.0} if resolve_device_kind(od_config.device) == "cuda" else {"CPU": 1.0}
    return {**device, **od_config.ray.resources}


def check_placement(od_config: OmniDiffusionConfig) -> None:
    """Fail at start-up, naming the stage, when no node of the cluster (or no set of nodes, for a strategy that
    may spread) has the resources of the stage's ranks; Ray itself would wait for such a node forever."""
    import ray

    connect(od_config.ray.address)
    world = od_config.parallel_config.world_size
    bundle = rank_bundle(od_config)
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]

    capacity = [min(int(node.get(name, 0.0) // amount) for name, amount in bundle.items()) for node in nodes]
    strategy = od_config.ray.strategy
    if strategy == "STRICT_PACK":
        ok = max(capacity, default=0) >= world
    elif strategy == "STRICT_SPREAD":
        ok = sum(c >= 1 for c in capacity) >= world
    else:
        ok = sum(capacity) >= world
    if not ok:
        raise OmniClientError(
            f"stage {od_config.stage_id}: placement {bundle} x {world} rank(s) ({strategy}) fits no node of the "
            f"Ray cluster (nodes: {[_custom(node) for node in nodes]})",
            param="placement",
        )


def _custom(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources without Ray's bookkeeping ones (memory, object store, node:<ip>)."""
    return {
        k: v for k, v in resources.items() if k not in ("memory", "object_store_memory") and not k.startswith("node:")
    }


class DiffusionRankActor:
    """One diffusion rank in a Ray actor process: the mp worker loop without the death pipe (Ray ends an
    actor with the process that created it)."""

    def where(self) -> tuple[str, int, int, str]:
        """This rank's node address, a free port there (rank 0's is the collectives' init port), its pid and its
        node's id."""
        import ray
        from vllm.utils.network_utils import get_open_port

        return ray.util.get_node_ip_address(), get_open_port(), os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, spec: WorkerSpec) -> int:
        """Serve until the executor's Shutdown; returns the exit code a worker process would have."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        configure_process_logging(
            spec.od_config.logging_config, f"DiffusionWorker_S{spec.od_config.stage_id}_R{spec.rank}"
        )
        return WorkerProc.run(spec)


class _RayRank:
    """A rank's actor as the base executor sees a worker process: alive while its `run` call is, with a
    sentinel (a pipe that closes when the call ends) the monitor can wait on beside the others."""

    def __init__(self, actor: Any, run_ref: Any, rank: int, pid: int, node_id: str) -> None:
        self.actor = actor
        self.name = f"DiffusionRankActor-{rank}"
        self.pid = pid
        self.node_id = node_id
        self.exitcode: int | None = None
        self._ref = run_ref
        self._done = threading.Event()
        self.sentinel, self._sentinel_w = os.pipe()
        weakref.finalize(self, os.close, self.sentinel)
        threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()

    def _watch(self) -> None:
        import ray

        try:
            while not ray.wait([self._ref], timeout=_RANK_WATCH_POLL_S)[0]:
                pass
            self.exitcode = ray.get(self._ref, timeout=_CALL_TIMEOUT_S)
        except Exception as exc:  # the actor (or its node) died: RayActorError, or Ray itself went away
            logger.warning("%s: %s", self.name, " ".join(str(exc).split())[:300])
            self.exitcode = -9
        self._done.set()
        os.close(self._sentinel_w)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(_CALL_TIMEOUT_S if timeout is None else timeout)

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone, or Ray shut down first
            logger.debug("ray.kill(%s) failed", self.name, exc_info=True)

    terminate = kill


class RayDiffusionExecutor(MultiprocDiffusionExecutor):
    shm_threshold = sys.maxsize
    """Nothing through shared memory: a rank may be on another node."""

    def __init__(self, od_config: OmniDiffusionConfig) -> None:
        import ray

        placement: RayPlacement = od_config.ray
        connect(placement.address)
        self._node_ip = ray.util.get_node_ip_address()
        self._release_lock = threading.Lock()
        self._placement_group = None
        super().__init__(od_config)

    def _bind(self, sock: Any, name: str) -> None:
        port = sock.bind_to_random_port(f"tcp://{self._node_ip}")
        self._addresses[name] = f"tcp://{self._node_ip}:{port}"

    def _launch_workers(self) -> list[_RayRank]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_placement(self.od_config)
        bundle = rank_bundle(self.od_config)
        group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=self.od_config.ray.strategy)
        self._placement_group = group
        actors = []
        try:
            ray.get(group.ready(), timeout=self.od_config.init_timeout)
            actor_cls = ray.remote(DiffusionRankActor)
            actors = [
                actor_cls.options(
                    num_cpus=bundle.get("CPU", 0.0),
                    num_gpus=bundle.get("GPU", 0.0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                ).remote()
                for rank in range(self.world_size)
            ]
            places = ray.get([actor.where.remote() for actor in actors], timeout=self.od_config.init_timeout)
        except BaseException as exc:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            self._release()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise RuntimeError(
                    f"stage {self.od_config.stage_id}: its {self.world_size} Ray rank(s) ({bundle} "
                    f"each) were not placed within {self.od_config.init_timeout:.0f} s (the "
                    "resources exist but are taken)"
                ) from None
            raise
        init_method = None
        if self.world_size > 1:
            ip, port = places[0][:2]
            init_method = f"tcp://{ip}:{port}"
            self._tp_shm_prefixes.append(f"{port}-")  # VLLM_DIST_IDENT (parallel_state.py)
        return [
            _RayRank(actor, actor.run.remote(self._worker_spec(rank, init_method)), rank, *places[rank][2:])
            for rank, actor in enumerate(actors)
        ]

    def check_workers(self) -> None:
        super().check_workers()
        if self._is_failed and not self._closed:  # a dead rank's actors and bundles go before the restart places anew
            self._release()

    def shutdown(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        super().shutdown(timeout)
        self._release()

    def _release(self) -> None:
        """Kill every rank's actor (one whose `run` returned still holds its bundle) and free the placement group."""
        import ray

        with self._release_lock:
            for rank in getattr(self, "processes", []):
                rank.kill()
            group, self._placement_group = self._placement_group, None
            if group is not None:
                try:
                    ray.util.remove_placement_group(group)
                except Exception:
                    logger.debug("remove_placement_group failed", exc_info=True)
