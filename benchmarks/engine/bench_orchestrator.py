"""Control-plane overheads with trivial stages, and connector throughput vs a plain memcpy.

1. Hop latency: an `AsyncOmniEngine` whose stages echo their input instantly (no model), 1 vs 3 stages
   chained with `text_to_prompt`; round trip = add_request -> final output on the caller's loop (the engine
   runs there; before it ran on a thread of its own and the round trip crossed to it and back).
   Per hop = (t3 - t1) / 2.
2. Connector throughput: shared-memory put + get of one tensor vs `empty_like(x).copy_(x)` of the same bytes
   (the in-process connector hands the object over and copies nothing).

  .venv/bin/python benchmarks/engine/bench_orchestrator.py
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.connectors.base import StagePayload
from vllm_omni.connectors.shm_connector import SharedMemoryConnector
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.outputs import OmniRequestOutput


class EchoStage(StageClientBase):
    """A stage with no model: returns its prompt as text at once."""

    kind = StageKind.AR

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt, sampling_params):
        yield OmniRequestOutput(request_id=request_id, finished=True, stage_id=self.stage_id, text=str(prompt))

    async def abort(self, request_ids):
        return None

    def default_sampling_params(self):
        return None

    @property
    def output_modality(self) -> str:
        return "text"

    @property
    def is_dead(self) -> bool:
        return False

    def shutdown(self) -> None:
        return None


def chain(n: int) -> VllmOmniConfig:
    stages = [VllmOmniARStageConfig(stage_id=i, model="echo", final_output=i == n - 1,
                                    inputs=[i - 1] if i else [], input_processor="text_to_prompt" if i else None)
              for i in range(n)]
    return VllmOmniConfig(model="echo", model_path="echo", pipeline_name=f"echo-{n}", stages=stages)


def round_trips(num_stages: int, requests: int) -> list[float]:
    engine = AsyncOmniEngine(chain(num_stages), stage_client_factory=EchoStage)

    async def run() -> list[float]:
        outputs: asyncio.Queue = asyncio.Queue()
        times = []
        for i in range(requests + 50):
            start = time.perf_counter()
            engine.add_request(f"r{i}", "hello", [None] * num_stages, outputs.put_nowait)
            out = await asyncio.wait_for(outputs.get(), 10)
            assert out.finished and out.text == "hello", out
            if i >= 50:
                times.append(time.perf_counter() - start)
        return times

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def connector_throughput(mib: int, repeats: int) -> dict[str, float]:
    x = torch.randn(mib * 1024 * 1024 // 4)
    nbytes = x.numel() * 4
    conn = SharedMemoryConnector(threshold_bytes=0)
    memcpy, alloc_copy, shm = [], [], []
    dst = torch.empty_like(x).copy_(x)  # pages touched once: a pure memcpy
    for i in range(repeats):
        start = time.perf_counter()
        dst.copy_(x)
        memcpy.append(time.perf_counter() - start)
        start = time.perf_counter()
        y = torch.empty_like(x).copy_(x)
        alloc_copy.append(time.perf_counter() - start)
        del y
        start = time.perf_counter()
        got = conn.get(conn.put(f"r{i}", 0, 1, StagePayload(tensors={"x": x})))
        shm.append(time.perf_counter() - start)
        del got
        gc.collect()
    conn.close()
    gbps = lambda ts: nbytes / statistics.median(ts) / 1e9
    return {"MiB": mib, "memcpy_GBps": gbps(memcpy), "alloc_copy_GBps": gbps(alloc_copy), "shm_GBps": gbps(shm),
            "shm_vs_memcpy": statistics.median(memcpy) / statistics.median(shm),
            "shm_vs_alloc_copy": statistics.median(alloc_copy) / statistics.median(shm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    one, three = round_trips(1, args.requests), round_trips(3, args.requests)
    med1, med3 = statistics.median(one) * 1e6, statistics.median(three) * 1e6
    hops = {"round_trip_1_stage_us": med1, "round_trip_3_stages_us": med3, "per_hop_us": (med3 - med1) / 2}
    print(f"\n{'trivial stages':<16}{'median round trip us':>22}")
    print(f"{'1 stage':<16}{med1:>22.1f}\n{'3 stages':<16}{med3:>22.1f}\n{'per hop':<16}{hops['per_hop_us']:>22.1f}")

    rows = [connector_throughput(mib, args.repeats) for mib in args.sizes_mib]
    print(f"\n{'MiB':>6}{'memcpy GB/s':>13}{'alloc+copy GB/s':>17}{'shm put+get GB/s':>18}"
          f"{'shm/memcpy':>12}{'shm/alloc+copy':>16}")
    for r in rows:
        print(f"{r['MiB']:>6}{r['memcpy_GBps']:>13.2f}{r['alloc_copy_GBps']:>17.2f}{r['shm_GBps']:>18.2f}"
              f"{r['shm_vs_memcpy']:>12.2f}{r['shm_vs_alloc_copy']:>16.2f}")

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parents[1] / "results" / f"bench_orchestrator-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hops": hops, "connector": rows, "command": " ".join(sys.argv),
                               "python": platform.python_version(), "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
