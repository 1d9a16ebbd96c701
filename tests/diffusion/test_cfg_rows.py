"""The skeleton's classifier-free guidance rows (no model): which rows a guided step runs, how a request leaving
keeps the others' rows and guidance, and how the two branches combine.

Pins: per-latent-row fields get their unconditional rows appended (all rows, or only the guided subset), prompt
fields keep theirs and are cut to the latent rows at a step without CFG, a shared entry stays one; dropping a
latent row remaps a subset's unconditional rows and drops guidance once no guided row is left; `guide` combines
only the guided rows (`uncond + scale * (cond - uncond)`) and leaves the others as predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, prompt_rows, rows, with_uncond_rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, select_conditioning
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@dataclass
class StepInput:
    x: torch.Tensor = rows()
    ids: tuple[int, ...] = rows()
    text: torch.Tensor = rows(text=True)
    table: torch.Tensor = rows(dim=1, shared=True)


@dataclass
class Cond(Conditioning):
    text: torch.Tensor
    cfg: CFG | None

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> Cond:
        return Cond(self.text.index_select(0, text_rows), self.cfg)


def _input(num_latent: int, num_text: int) -> StepInput:
    return StepInput(torch.arange(num_latent), tuple(range(num_latent)), torch.arange(num_text) + 100,
                     torch.zeros(2, 1))


def test_every_latent_row_gets_an_unconditional_row():
    inp = with_uncond_rows(_input(3, 6), 3, CFG(2.0))
    assert inp.x.tolist() == [0, 1, 2, 0, 1, 2] and inp.ids == (0, 1, 2, 0, 1, 2)
    assert inp.text.tolist() == [100, 101, 102, 103, 104, 105] and inp.table.shape == (2, 1)


def test_a_subset_guides_only_its_rows_and_a_step_without_cfg_cuts_the_prompt_rows():
    inp = with_uncond_rows(_input(3, 4), 3, CFG(2.0, uncond=torch.tensor([2])))
    assert inp.x.tolist() == [0, 1, 2, 2] and inp.ids == (0, 1, 2, 2) and inp.text.tolist() == [100, 101, 102, 103]
    inp = with_uncond_rows(_input(3, 6), 3, None)
    assert inp.x.tolist() == [0, 1, 2] and inp.text.tolist() == [100, 101, 102]


def test_dropping_rows_keeps_the_others_unconditional_rows_and_guidance():
    cond = Cond(torch.arange(6), CFG(2.0))
    kept = select_conditioning(cond, torch.tensor([0, 2]), 3)
    assert kept.text.tolist() == [0, 2, 3, 5] and kept.cfg == cond.cfg
    # Latent rows 1 and 3 of 4 guided (text rows 4, 5): dropping row 1 leaves row 3 (now 2) with text row 5.
    cond = Cond(torch.arange(6), CFG(2.0, uncond=torch.tensor([1, 3])))
    kept = select_conditioning(cond, torch.tensor([0, 2, 3]), 4)
    assert kept.text.tolist() == [0, 2, 3, 5] and kept.cfg.uncond.tolist() == [2] and kept.do_cfg
    kept = select_conditioning(cond, torch.tensor([0, 2]), 4)
    assert kept.text.tolist() == [0, 2] and kept.cfg is None and not kept.do_cfg


class _Pipe(NativeDiffusionPipeline):
    pass


class _State:
    def __init__(self, num_latent: int, cond: Cond) -> None:
        self.latents, self.conditioning = torch.zeros(num_latent), cond


def test_guide_combines_only_the_guided_rows():
    pipe = _Pipe()
    pred = torch.tensor([[1.0], [2.0], [3.0], [0.5]])  # latent rows 0..2, then latent row 1's unconditional row
    state = _State(3, Cond(torch.zeros(4), CFG(3.0, uncond=torch.tensor([1]))))
    assert pipe.guide(state, pred).flatten().tolist() == [1.0, 0.5 + 3.0 * (2.0 - 0.5), 3.0]
    assert pipe.transformer_rows(state) == 4 and pipe.transformer_row_sources(state) == [0, 1, 2, 1]
    state = _State(3, Cond(torch.zeros(3), None))
    assert torch.equal(pipe.guide(state, pred[:3]), pred[:3])


def test_prompt_rows_are_the_prompts_then_the_negatives():
    sp = OmniDiffusionSamplingParams()
    requests = [OmniDiffusionRequest({"prompt": "a", "negative_prompt": "x"}, sp, "r0"),
                OmniDiffusionRequest("b", sp, "r1")]
    assert prompt_rows(requests, CFG(2.0)) == [("a", 0), ("b", 1), ("x", 0), ("", 1)]
    assert prompt_rows(requests, None) == [("a", 0), ("b", 1)]
