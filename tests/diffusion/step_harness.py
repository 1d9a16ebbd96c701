"""The engine's `DiffusionScheduler` and one rank's `StepWorker` driven in this process, round by round, for the
step-execution tests (what the engine's step thread and a worker's loop do, without the sockets)."""

from __future__ import annotations

from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.step_runner import StepWorker
from vllm_omni.errors import RequestAbortedError


class Runner:
    """What the worker reads of a `DiffusionModelRunner`: the loaded pipeline and its config."""

    def __init__(self, pipeline, max_num_seqs: int, **config) -> None:
        self.pipeline = pipeline
        self.od_config = OmniDiffusionConfig(model="tiny", max_num_seqs=max_num_seqs, step_execution=True, **config)

    def peak_memory_mb(self) -> float:
        return 0.0


class Aborts:
    def __init__(self) -> None:
        self.pairs: set[tuple[int, str]] = set()

    def contains(self, batch_id: int, request_id: str) -> bool:
        return (batch_id, request_id) in self.pairs

    def forget_through(self, batch_id: int) -> None:
        self.pairs = {p for p in self.pairs if p[0] > batch_id}


class InProcessSteps:
    """Batches in (`add`), one `send(batch_id, outputs)` per batch once all its requests left; `resident` and
    `paused` are the worker's states in the scheduler's order, `waiting` the scheduler's jobs."""

    def __init__(self, runner, send, aborts) -> None:
        self.runner = runner
        self.scheduler = DiffusionScheduler(runner.od_config)
        self.worker = StepWorker(runner)
        self.send = send
        self.aborts = aborts
        self._batches: dict[int, list[DiffusionOutput | None]] = {}
        self._where: dict[str, tuple[int, int]] = {}
        self._sinks: dict[str, object] = {}
        self._aborted: set[str] = set()

    @property
    def policy(self):
        return self.scheduler.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.scheduler.policy = policy

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def resident(self):
        return [self.worker.states[job.request_id] for job in self.scheduler.resident]

    @property
    def paused(self):
        return [self.worker.states[job.request_id] for job in self.scheduler.paused]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, batch_id: int, requests: list[OmniDiffusionRequest], partial_sink) -> None:
        self._batches[batch_id] = [None] * len(requests)
        for index, request in enumerate(requests):
            self._where[request.request_id] = (batch_id, index)
            if partial_sink is not None:
                self._sinks[request.request_id] = partial_sink
            self.scheduler.add(request, stream=partial_sink is not None)

    def run_round(self) -> None:
        config = self.runner.od_config  # tests may swap it between rounds
        self.scheduler.max_resident, self.scheduler.max_paused = config.max_num_seqs, config.max_paused_states
        aborted = [rid for rid, (batch_id, _) in self._where.items()
                   if rid not in self._aborted and self.aborts.contains(batch_id, rid)]
        self._aborted.update(aborted)
        for job in self.scheduler.abort(aborted):
            self._leave(job.request_id, DiffusionOutput.from_exception(RequestAbortedError()))
        plan = self.scheduler.schedule()
        result = self.worker.execute(plan, lambda rid, kind, data: self._sinks[rid](rid, kind, data))
        for job, output in self.scheduler.update(plan, result):
            self._leave(job.request_id, output)

    def _leave(self, request_id: str, output: DiffusionOutput) -> None:
        batch_id, index = self._where.pop(request_id)
        outputs = self._batches[batch_id]
        outputs[index] = output
        if all(out is not None for out in outputs):
            del self._batches[batch_id]
            self.send(batch_id, outputs)
            self.aborts.forget_through(min(self._batches, default=batch_id + 1) - 1)


class Harness:
    """Steps with one request per batch (batch id = submission order), outputs by request id."""

    def __init__(self, pipeline, max_num_seqs: int = 4, **config) -> None:
        self.aborts = Aborts()
        self.outputs: dict[str, DiffusionOutput] = {}
        self.finished_at: dict[str, int] = {}
        self.rounds = 0
        self.ids: dict[str, int] = {}
        self.executor = InProcessSteps(Runner(pipeline, max_num_seqs, **config), self._send, self.aborts)

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
