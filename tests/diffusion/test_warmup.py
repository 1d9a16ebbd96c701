"""The compiled path is the CUDA default, and start-up warms up every (shape, batch bucket) before serving."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig, parse_warmup_shapes
from vllm_omni.diffusion.layers import compile as compile_mod
from vllm_omni.diffusion.layers.compile import AcceleratedForward, accelerate_transformer, accelerated_forwards
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.warmup import _request as _warmup_request
from vllm_omni.diffusion.warmup import batch_buckets, step_bucket, warm_up
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.fixture(scope="module")
def qwen_image_dir():
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("qwen-image")


def _default_od_config(*flags: str) -> OmniDiffusionConfig:
    """The diffusion config `vllm serve tiny/qwen-image --omni *flags` gives its stage."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_omni.config.omni_config import StageConfigFactory
    from vllm_omni.engine.arg_utils import OmniEngineArgs
    from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser

    parser = make_omni_arg_parser(FlexibleArgumentParser())
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(parser.parse_args(["tiny/qwen-image", "--omni", *flags]),
                                                 parser.parse_args([]))
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs).stages
    return stage.make_od_config()


def test_enforce_eager_resolves_by_device():
    """Unset: compiled on CUDA, eager on CPU; an explicit value is kept (on CPU nothing compiles either way)."""
    assert OmniDiffusionConfig(model="m", device="cpu").enforce_eager is True
    assert OmniDiffusionConfig(model="m", device="cuda").enforce_eager is False
    assert OmniDiffusionConfig(model="m", device="cuda", enforce_eager=True).enforce_eager is True
    assert OmniDiffusionConfig(model="m", device="cpu", enforce_eager=False).enforce_eager is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU default")
def test_default_serve_config_is_eager_on_cpu():
    od_config = _default_od_config()
    assert od_config.enforce_eager is True
    assert _default_od_config("--no-enforce-eager").enforce_eager is False


def test_warmup_shapes_are_parsed_and_bad_ones_named():
    assert parse_warmup_shapes(None) is None
    assert parse_warmup_shapes("") == []
    assert parse_warmup_shapes("512x512, 1024X768") == [(512, 512), (1024, 768)]
    for bad in ("512", "512x", "0x512", "axb"):
        with pytest.raises(OmniClientError, match="--diffusion-warmup-shapes") as info:
            OmniDiffusionConfig(model="m", diffusion_warmup_shapes=bad)
        assert info.value.param == "diffusion_warmup_shapes"
    assert _default_od_config("--diffusion-warmup-shapes", "64x64").diffusion_warmup_shapes == "64x64"


def test_batch_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert [batch_buckets(n) for n in (1, 2, 3, 4, 6, 8)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6],
                                                               [1, 2, 4, 8]]
    assert [step_bucket(n, [1, 2, 4, 6]) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, 7]
    assert step_bucket(3, []) == 3  # eager: no padding


def test_step_batch_is_padded_to_the_next_bucket(dist_world, qwen_image_dir):
    """Compiled path: 3 co-batched states run as one forward of the bucket 4 (the last state's rows repeated and
    dropped again): every state advances as in the unpadded eager forward."""
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    config = OmniDiffusionConfig(model=str(qwen_image_dir), max_num_seqs=4)
    pipes = [QwenImagePipeline.from_pretrained(config, qwen_image_dir, torch.device("cpu"), torch.float32)
             for _ in range(2)]
    accelerate_transformer(pipes[1].transformer, compile_blocks=False, cuda_graphs=False)
    (forward,) = accelerated_forwards(pipes[1])
    rows, inner = [], forward.forward
    forward.forward = lambda *args, **kwargs: rows.append(args[0].shape[0]) or inner(*args, **kwargs)
    latents = []
    with torch.inference_mode():
        for pipe in pipes:
            requests = [_warmup_request((32, 32), i) for i in range(3)]
            ctxs = [StepContext(pipe.od_config, request_ids=[r.request_id]) for r in requests]
            states = [pipe.prepare([r], ctx) for r, ctx in zip(requests, ctxs, strict=True)]
            assert pipe.denoise_step_batch(states, ctxs) == [None] * 3
            latents.append([state.latents for state in states])
    assert (pipes[0].step_buckets, pipes[1].step_buckets) == ([], [1, 2, 4])
    assert rows == [4]
    for eager, padded in zip(*latents, strict=True):
        torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-4)


def _request(prompt: str, **params) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(num_inference_steps=2, seed=0, **params), "r")


def test_warm_up_runs_each_bucket_then_warns_on_serving_compiles(dist_world, qwen_image_dir, monkeypatch):
    """Request mode warms every bucket; step mode only the buckets one forward can hold; afterwards a forward
    that compiles logs a WARNING with its input shapes and is counted (Dynamo's counter isolated: on the CPU
    nothing compiles)."""
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(qwen_image_dir)), qwen_image_dir,
                                             torch.device("cpu"), torch.float32)
    assert warm_up(pipe, OmniDiffusionConfig(model="m", diffusion_warmup_shapes="64x64")) == []  # eager
    accelerate_transformer(pipe.transformer, compile_blocks=False, cuda_graphs=False)
    (forward,) = accelerated_forwards(pipe)
    with torch.inference_mode():
        request_mode = warm_up(pipe, OmniDiffusionConfig(model="m", max_num_seqs=2, diffusion_warmup_shapes="64x64"))
        assert [s.label for s in request_mode] == ["64x64 batch 1", "64x64 batch 2"]
        forward.serving = False
        tokens = {size: [sum(pipe.step_tokens(pipe.prepare([_warmup_request((size, size), i, lengths)],
                                                           StepContext(pipe.od_config))) for i in range(2))
                         for lengths in range(2)] for size in (64, 32)}
        # A cap of 32x32's batch 2 leaves 64x64 at batch 1, 32x32 below batch 4 (3 states do not fit).
        assert min(tokens[64]) > max(tokens[32])
        tokens = {size: max(counts) for size, counts in tokens.items()}
        step_mode = warm_up(pipe, OmniDiffusionConfig(model="m", max_num_seqs=4, step_execution=True,
                                                      diffusion_warmup_shapes="64x64,32x32",
                                                      diffusion_max_tokens_per_forward=tokens[32]))
        assert [s.label for s in step_mode] == ["64x64 batch 1", "32x32 batch 1", "32x32 batch 2"]
        assert forward.serving and forward.serving_compiles == 0

        graphs = iter(range(0, 100, 3))
        monkeypatch.setattr(compile_mod, "dynamo_graphs", lambda: next(graphs))
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger(compile_mod.__name__).addHandler(handler)
        try:
            (out,) = pipe.forward(DiffusionRequestBatch([_request("a boat", height=32, width=32)]))
        finally:
            logging.getLogger(compile_mod.__name__).removeHandler(handler)
    assert out.error is None, out.error
    assert forward.serving_compiles == 3 * 2  # one forward per step
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "compile while serving: 3 graph(s) compiled" in warnings[0]
    assert "arg0=1x4x64" in warnings[0]  # the batch rows and image tokens of the forward that compiled


@pytest.mark.cuda
def test_default_serve_config_is_compiled_on_cuda_and_warmed_up(dist_world, qwen_image_dir):
    """No flags on CUDA: the model runner loads the compiled path and warms up before it returns; a request of
    a warmed signature then neither compiles nor captures, one of a new size does (and is counted)."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    od_config = _default_od_config("--max-num-seqs", "2", "--diffusion-warmup-shapes", "64x64")
    assert od_config.enforce_eager is False
    od_config.model = str(qwen_image_dir)
    runner = DiffusionModelRunner(od_config, torch.device("cuda", torch.cuda.current_device()))
    runner.load_model()
    (forward,) = accelerated_forwards(runner.pipeline)
    assert isinstance(forward, AcceleratedForward) and forward.serving
    assert forward.compiles >= 1 and forward.captures >= 2  # batch 1 and batch 2
    warmed = _warmup_request((64, 64), 0).prompt
    with torch.inference_mode():
        (out,) = runner.pipeline.forward(DiffusionRequestBatch([_request(warmed, height=64, width=64)]))
        assert out.error is None, out.error
        assert (forward.serving_compiles, forward.serving_captures) == (0, 0)
        (out,) = runner.pipeline.forward(DiffusionRequestBatch([_request(warmed, height=32, width=32)]))
    assert out.error is None, out.error
    assert forward.serving_captures >= 1
