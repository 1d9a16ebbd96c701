"""`StageKind` is the one stage-kind vocabulary: YAML names parse into it, the user-visible names ("llm") come
from it, and no code outside `vllm_omni/config/` compares a stage-kind string (checked over the AST)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from vllm_omni.config import PipelineConfig, StageExecutionType, StageKind, VllmOmniConfig
from vllm_omni.config.stage_config import (
    VllmOmniARStageConfig,
    VllmOmniDiffusionStageConfig,
    VllmOmniGenerationStageConfig,
)

KIND_NAMES = frozenset({"llm", "ar", "diffusion", "generation"})
PACKAGE = Path(__file__).resolve().parents[2] / "vllm_omni"


def test_yaml_names_parse_into_the_enum(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nstages:\n  - {stage_id: 0, execution_type: ar}\n"
                    "  - {stage_id: 1, execution_type: diffusion, inputs: [0], input_processor: text_to_prompt,"
                    " final_output: true}\n")
    pipeline = PipelineConfig.from_yaml(path)
    assert [s.execution_type for s in pipeline.stages] == [StageKind.AR, StageKind.DIFFUSION]
    assert StageExecutionType is StageKind
    assert StageKind("llm") is StageKind.AR  # the name users have always seen for AR stages
    with pytest.raises(ValidationError, match="execution_type"):
        PipelineConfig(name="x", stages=[{"stage_id": 0, "execution_type": "vocoder", "final_output": True}])


def test_user_visible_names_are_kept():
    assert [k.stage_type for k in StageKind] == ["llm", "generation", "diffusion"]
    stages = [VllmOmniARStageConfig(stage_id=0, model="m"),
              VllmOmniGenerationStageConfig(stage_id=1, model="m", inputs=[0]),
              VllmOmniDiffusionStageConfig(stage_id=2, model="m", inputs=[1], final_output=True)]
    config = VllmOmniConfig(model="m", model_path="m", pipeline_name="p", stages=stages)
    assert config.stage_kinds == [StageKind.AR, StageKind.GENERATION, StageKind.DIFFUSION]
    assert config.stage_types == ["llm", "generation", "diffusion"]
    assert [s.name for s in stages] == ["stage-0-llm", "stage-1-generation", "stage-2-diffusion"]


def kind_string_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every ==, !=, in, not in, `case` whose operand is a stage-kind name."""
    hits = []

    def names(node: ast.AST) -> list[str]:
        items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return [i.value for i in items if isinstance(i, ast.Constant) and i.value in KIND_NAMES]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            ops_ok = all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)
            if ops_ok:
                hits += [(node.lineno, n) for operand in [node.left, *node.comparators] for n in names(operand)]
        elif isinstance(node, ast.MatchValue):
            hits += [(node.lineno, n) for n in names(node.value)]
    return hits


def test_the_checker_finds_each_shape():
    src = ('a == "llm"\n"diffusion" != b\nc in ("ar", "x")\nd not in {"generation"}\n'
           'match e:\n    case "llm":\n        pass\nf == "text"\ng is StageKind.AR\n')
    assert kind_string_comparisons(src) == [(1, "llm"), (2, "diffusion"), (3, "ar"), (4, "generation"), (6, "llm")]


def test_no_stage_kind_string_is_compared_outside_config():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}"
                 for path in sorted(PACKAGE.rglob("*.py")) if "config" not in path.relative_to(PACKAGE).parts[:1]
                 for line, name in kind_string_comparisons(path.read_text())]
    assert not offenders, "compare StageKind members, not strings:\n" + "\n".join(offenders)
