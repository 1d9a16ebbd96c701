"""Layer 1a: the stage graph of a model (what runs, in which order, fed by what).

A `PipelineConfig` is the single source of truth for topology. It never says where a stage runs or how
many replicas it has: that is `DeployConfig`'s job.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from vllm_omni.config.stage_kind import StageKind

FORBID = ConfigDict(extra="forbid")
OutputModality = Literal["text", "image", "video", "audio"]
EdgeField = Literal["chunk_tokens", "first_chunk_tokens", "idle_chunk_growth", "chunk_schedule"]
"""The `EdgeStreamConfig` fields besides `stream`: each applies only where something reads it."""
HAND_OFF_FIELDS: frozenset[EdgeField] = frozenset({"chunk_tokens", "first_chunk_tokens", "idle_chunk_growth"})
"""What the orchestrator reads on a streamed edge (when it hands the upstream's output on)."""
AR_DOWNSTREAM_FIELDS: frozenset[EdgeField] = frozenset({"idle_chunk_growth"})
"""Of those, what applies only when the downstream is an AR stage (only a stream-fed AR stage waits for input)."""


StageExecutionType = StageKind
"""The former name of `StageKind`, kept for user code importing it (YAML says `execution_type: ar`)."""


@dataclass(config=FORBID)
class EdgeStreamConfig:
    """How one upstream stage's output reaches a stage: chunk by chunk while the upstream still runs
    (`stream: true`), or once the upstream finished (store-and-forward)."""

    stream: bool = True
    chunk_tokens: Annotated[int, Field(ge=1)] = 1
    """Upstream output tokens per hand-off (the upstream is an AR stage; the Qwen3-Omni talker's tokens are
    codec frames). How the downstream input is cut (e.g. into vocoder chunks) is its input processor's, the same
    streamed or not, so turning `stream` off changes when a stage runs, not what it computes. A stream-fed AR
    stage that has consumed its input and waits gets the upstream's newest tokens sooner (`idle_chunk_growth`)."""
    first_chunk_tokens: Annotated[int, Field(ge=1)] | None = None
    """Upstream tokens before the first hand-off (None: `chunk_tokens`): small so the downstream starts early,
    with a larger `chunk_tokens` after it for fewer hand-offs."""
    idle_chunk_growth: Annotated[float, Field(ge=0)] = 1.0
    """A stream-fed AR stage that waits for input gets the upstream's newest tokens once they number
    `idle_chunk_growth` x the tokens handed on so far (at least 1, at most `chunk_tokens`), instead of at the next
    `chunk_tokens` boundary. Each hand-off it takes is one more input chunk, one more request to its EngineCore:
    with growth the hand-offs grow geometrically up to `chunk_tokens` (1: each as large as all before it), so
    their number is bounded by the upstream's output length, whatever the two stages' relative speed (N tokens:
    about log_{1+growth}(chunk_tokens / first_chunk_tokens) + N / chunk_tokens, plus the one at the end); 0 hands
    on at once (a downstream faster than its upstream then takes one chunk per two or three upstream tokens).
    Larger values, or a larger `chunk_tokens`, mean fewer round trips but more downstream work left when the
    upstream finishes."""
    chunk_schedule: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """Sizes of the pieces the downstream's input processor cuts its input into, in order, the last one repeating
    (Qwen3-Omni code2wav: vocoder chunks in codec frames, e.g. `[4, 8, 16, 32]`: the first audio after 4 frames,
    then larger chunks, each with the model's left context). Used streamed or not, so both give the same output;
    empty: the processor's default."""

    def first_hand_off(self) -> int:
        return self.first_chunk_tokens or self.chunk_tokens

    def hand_off_due(self, handed_on: int, downstream_waits: bool) -> int:
        """New upstream tokens that make the next hand-off, `handed_on` tokens having been handed on so far."""
        if handed_on == 0:
            return self.first_hand_off()
        if downstream_waits:
            return max(1, min(self.chunk_tokens, math.ceil(self.idle_chunk_growth * handed_on)))
        return self.chunk_tokens

    def set_fields(self) -> list[EdgeField]:
        """The fields besides `stream` that differ from their defaults (those a pipeline asks for)."""
        default = EdgeStreamConfig()
        return [f.name for f in dataclasses.fields(self)
                if f.name != "stream" and getattr(self, f.name) != getattr(default, f.name)]


@dataclass(config=FORBID)
class PipelineStageConfig:
    stage_id: Annotated[int, Field(ge=0)]
    execution_type: StageKind
    model: str | None = None
    """Model of this stage; None = the pipeline's model (or `model_subfolder` inside it)."""
    model_subfolder: str | None = None
    inputs: list[int] = Field(default_factory=list)
    """Upstream stage ids whose outputs feed this stage; empty = the user's prompt."""
    stream_inputs: dict[int, EdgeStreamConfig] = Field(default_factory=dict)
    """Upstream stage id -> how that edge streams; edges not named are store-and-forward. Streaming needs an
    AR upstream and that one input: a GENERATION stage runs each chunk as one segment of the request, an AR stage
    runs the request as a vLLM streaming-input request whose input chunks its input processor makes. Pipeline
    resolution refuses a field nothing on the edge reads: `chunk_tokens` / `first_chunk_tokens` apply to streamed
    edges (or a processor that declares it reads them), `chunk_schedule` only to a processor that declares it
    (`stage_input_processors.reads`)."""
    input_processor: str | None = None
    """Name of the stage-input processor (engine/stage_input_processors.py) building this stage's input (on an
    entry stage, from the caller's prompt)."""
    output_collector: str | None = None
    """Name of the output collector (engine/output_collectors.py) an AR stage awaits per finished request."""
    final_output: bool = False
    final_output_type: OutputModality | None = None
    """None = whatever the stage's engine produces (text for AR, the pipeline's modality for diffusion)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Model-defined engine defaults; deploy config and user overrides win over them."""
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)


@dataclass(config=FORBID)
class PipelineConfig:
    name: str
    stages: list[PipelineStageConfig]

    def __post_init__(self) -> None:
        self._validate_ids()
        self._validate_edges()

    def _validate_ids(self) -> None:
        ids = [s.stage_id for s in self.stages]
        if ids != list(range(len(ids))) or not ids:
            raise ValueError(f"pipeline {self.name!r}: stage ids must be 0..N-1 in order, got {ids}")
        if not any(s.final_output for s in self.stages):
            raise ValueError(f"pipeline {self.name!r}: no stage has final_output: true")

    def _validate_edges(self) -> None:
        for stage in self.stages:
            bad = [i for i in stage.inputs if not 0 <= i < stage.stage_id]
            if bad:
                raise ValueError(
                    f"pipeline {self.name!r}: stage {stage.stage_id} inputs {bad} must be earlier stages"
                )
            if stage.inputs and stage.input_processor is None:
                raise ValueError(
                    f"pipeline {self.name!r}: stage {stage.stage_id} has inputs but no input_processor"
                )
            self._validate_streams(stage)

    def _validate_streams(self, stage: PipelineStageConfig) -> None:
        where = f"pipeline {self.name!r}: stage {stage.stage_id} stream_inputs"
        for src, edge in stage.stream_inputs.items():
            if src not in stage.inputs:
                raise ValueError(f"{where}: {src} is not one of its inputs {stage.inputs}")
            if not edge.stream:
                continue
            if len(stage.inputs) != 1:
                raise ValueError(f"{where}: a streamed edge must be the stage's only input")
            if self.stages[src].execution_type is not StageKind.AR:
                raise ValueError(f"{where}: stage {src} is {self.stages[src].execution_type.value}; only AR "
                                 f"stages stream their output")
            if stage.execution_type is StageKind.DIFFUSION:
                raise ValueError(f"{where}: streamed input into a diffusion stage is not supported (AR and "
                                 f"GENERATION stages consume chunks)")

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineConfig:
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"pipeline config {path} must be a mapping")
        return cls(**data)

    @classmethod
    def single_stage(cls, name: str, execution_type: StageKind) -> PipelineConfig:
        return cls(name=name, stages=[PipelineStageConfig(stage_id=0, execution_type=execution_type,
                                                          final_output=True)])
