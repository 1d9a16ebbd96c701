"""A `StepExecutor` driven in this process, round by round, for the step-execution tests."""

from __future__ import annotations

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.step_runner import StepExecutor


class Runner:
    """What the executor reads of a `DiffusionModelRunner`: the loaded pipeline and its config."""

    def __init__(self, pipeline, max_num_seqs: int, **config) -> None:
        self.pipeline = pipeline
        self.od_config = OmniDiffusionConfig(model="tiny", max_num_seqs=max_num_seqs, **config)

    def peak_memory_mb(self) -> float:
        return 0.0


class Aborts:
    def __init__(self) -> None:
        self.pairs: set[tuple[int, str]] = set()

    def contains(self, batch_id: int, request_id: str) -> bool:
        return (batch_id, request_id) in self.pairs

    def forget_through(self, batch_id: int) -> None:
        self.pairs = {p for p in self.pairs if p[0] > batch_id}


class Harness:
    """A `StepExecutor` with one request per batch (batch id = submission order), outputs by request id."""

    def __init__(self, pipeline, max_num_seqs: int = 4, **config) -> None:
        self.aborts = Aborts()
        self.outputs: dict[str, DiffusionOutput] = {}
        self.finished_at: dict[str, int] = {}
        self.rounds = 0
        self.ids: dict[str, int] = {}
        self.executor = StepExecutor(Runner(pipeline, max_num_seqs, **config), self._send, self.aborts)

    def _send(self, batch_id: int, outputs: list[DiffusionOutput]) -> None:
        rid = next(r for r, b in self.ids.items() if b == batch_id)
        self.outputs[rid] = outputs[0]
        self.finished_at[rid] = self.rounds

    def add(self, request: OmniDiffusionRequest) -> None:
        self.ids[request.request_id] = len(self.ids)
        self.executor.add(self.ids[request.request_id], [request], None)

    def abort(self, request_id: str) -> None:
        self.aborts.pairs.add((self.ids[request_id], request_id))

    def round(self) -> None:
        self.rounds += 1
        self.executor.run_round()

    def drain(self, max_rounds: int = 100) -> None:
        while self.executor.has_work:
            assert self.rounds < max_rounds
            self.round()
