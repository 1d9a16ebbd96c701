"""What every entry point returns: one `OmniRequestOutput` per request (or per streamed chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OmniRequestOutput:
    """A request's output from one stage (the final stage unless streaming intermediate stages).

    `images` holds PIL images for image models; audio and video go in `multimodal_output`
    (`{"audio": np.ndarray, "sample_rate": int}` or `{"video": uint8 T×H×W×3 frames, "fps": int}`).
    `stage_durations` maps "stage_name" or "stage_name.phase" to seconds.
    """

    request_id: str
    finished: bool = True
    """The request's last output: every stage of it is done and its stream ends here."""
    stage_finished: bool | None = None
    """Its stage's last output (e.g. the whole audio), which may come before the request's last (the thinker's
    text, when the talker stopped first); None: as `finished`."""
    stage_id: int = 0
    final_output_type: str = "text"
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    request_output: Any = None
    """The AR stage's vLLM `RequestOutput`, when the output comes from an AR stage."""
    stage_data: dict[str, Any] = field(default_factory=dict)
    """What an AR stage's model returned in-band beside the tokens so far (catalog/edges.py `STAGE_DATA_KEY`),
    newest value per key; the stage's output collector reads it."""
    images: list[Any] = field(default_factory=list)
    multimodal_output: dict[str, Any] = field(default_factory=dict)
    stage_durations: dict[str, float] = field(default_factory=dict)
    cache: dict[str, Any] | None = None
    """What a diffusion stage's cache ran for this request (quality, backend, computed / reused block-steps;
    docs/cache.md); None for other stages."""
    peak_memory_mb: float = 0.0
    step_stats: StepStats | None = None
    """How a step-mode diffusion stage scheduled the request (feeds the server's metrics)."""
    compile_stats: CompileStats | None = None
    """A compiled diffusion stage's compile/capture counts when the request left (feeds the server's metrics)."""
    error: str | None = None
    error_status_code: int | None = None

    def __post_init__(self) -> None:
        if self.stage_finished is None:
            self.stage_finished = self.finished

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class StepStats:
    """How a diffusion request was scheduled (either mode); travels with its output to the server's Prometheus
    metrics."""

    shape: str
    """`shape_label` of the request (e.g. "512x512+cfg")."""
    step_seconds: list[float] = field(default_factory=list)
    step_batches: list[int] = field(default_factory=list)
    """States that shared each of `step_seconds`' forwards (1 = stepped alone)."""
    preemptions: int = 0
    """Times the request was paused at a step boundary for a more urgent one."""
    deadline_missed: bool = False
    """Finished after its deadline (requests with a `deadline_ms`, or any request under the slo policy)."""
    waiting: int = 0
    """Requests waiting (queued or paused) in the worker when this one left."""
    running: int = 0
    """Resident states stepping in the worker when this one left."""
    reserved_bytes: int = 0
    """Memory admission: the estimated bytes of the requests still on the workers when this one left."""
    budget_bytes: int | None = None
    """The stage's memory admission budget (None: no admission, e.g. CPU without --diffusion-memory-budget-gb)."""


@dataclass
class CompileStats:
    """A diffusion worker's compiled-path counts since it started (rank 0's; cumulative, so the server exports
    the increase). Serving-time ones stalled the requests of their forward (`layers/compile.CompiledForward`)."""

    compiles: int = 0
    """Graphs Dynamo compiled, start-up warm-up included."""
    captures: int = 0
    """CUDA graphs captured, start-up warm-up included."""
    serving_compiles: int = 0
    serving_captures: int = 0
