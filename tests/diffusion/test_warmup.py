"""The compiled path is the CUDA default, and start-up warms up every (shape, batch bucket) before serving."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig, parse_warmup_shapes
from vllm_omni.diffusion.layers import compile as compile_mod
from vllm_omni.diffusion.layers.compile import CompiledForward, accelerate_transformer, compiled_forwards
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
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(
        parser.parse_args(["tiny/qwen-image", "--omni", *flags]), parser.parse_args([])
    )
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
    assert [batch_buckets(n) for n in (1, 2, 3, 4, 6, 8)] == [
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 4, 6],
        [1, 2, 4, 8],
    ]
    assert [step_bucket(n, [1, 2, 4, 6]) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, 7]
    assert step_bucket(3, []) == 3  # eager: no padding


def _eager_and_compiled(model_dir, max_num_seqs: int, record) -> list:
    """An eager Qwen-Image pipeline and one on the compiled path whose transformer calls `record(args, kwargs)`
    before it runs (a forward hook: with no CUDA graph the compiled forward calls the module)."""
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    config = OmniDiffusionConfig(model=str(model_dir), max_num_seqs=max_num_seqs)
    pipes = [QwenImagePipeline.from_pretrained(config, model_dir, torch.device("cpu"), torch.float32) for _ in range(2)]
    accelerate_transformer(pipes[1].transformer, compile_blocks=False, cuda_graphs=False)
    pipes[1].transformer.register_forward_pre_hook(lambda module, args, kwargs: record(args, kwargs),
                                                   with_kwargs=True)
    return pipes


def test_step_batch_is_padded_to_the_next_bucket(dist_world, qwen_image_dir):
    """Compiled path: 3 co-batched states run as one forward of the bucket 4 (the last state's rows repeated and
    dropped again): every state advances as in the unpadded eager forward."""
    rows = []
    pipes = _eager_and_compiled(qwen_image_dir, 4, lambda args, kwargs: rows.append(args[0].shape[0]))
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


def test_request_batch_is_padded_to_the_next_bucket(dist_world, qwen_image_dir):
    """Request mode, compiled path: a batch of 3 requests runs every step as a forward of the bucket 4 (the last
    row repeated, its prediction dropped) and gives each request the eager pipeline's latents."""
    rows = []
    pipes = _eager_and_compiled(qwen_image_dir, 4, lambda args, kwargs: rows.append(args[0].shape[0]))
    outputs = []
    with torch.inference_mode():
        for pipe in pipes:
            requests = [
                _request(f"a boat {'at sea ' * i}", height=32, width=32, output_type="latent") for i in range(3)
            ]
            for i, r in enumerate(requests):
                r.request_id, r.sampling_params.seed = f"r{i}", i
            outputs.append(pipe.forward(DiffusionRequestBatch(requests)))
    assert rows == [4, 4]  # two steps
    for eager, padded in zip(*outputs, strict=True):
        assert eager.error is None and padded.error is None
        torch.testing.assert_close(padded.output, eager.output, atol=1e-5, rtol=1e-4)


def test_text_is_padded_to_its_bucket_under_a_mask(dist_world, qwen_image_dir):
    """Compiled path: co-batched prompts of other lengths run as ONE forward whose text is padded to the next
    bucket under a key mask, so the graph signature holds no prompt length; every state advances as in the
    eager forward (lengths, no padding). The warm-up's prompts land in each bucket a default request reaches."""
    from vllm_omni.diffusion.warmup import TEXT_BUCKETS

    seen = []
    pipes = _eager_and_compiled(qwen_image_dir, 2, lambda args, kwargs: seen.append((args[1].shape, args[2], kwargs)))
    latents = []
    with torch.inference_mode():
        for pipe in pipes:
            requests = [_request("a lighthouse", height=32, width=32), _request("a " * 40, height=32, width=32)]
            ctxs = [StepContext(pipe.od_config, request_ids=[r.request_id]) for r in requests]
            states = [pipe.prepare([r], ctx) for r, ctx in zip(requests, ctxs, strict=True)]
            lengths = [state.conditioning.prompt.lengths[0] for state in states]
            assert pipe.denoise_step_batch(states, ctxs) == [None] * 2
            latents.append([state.latents for state in states])
    assert pipes[0].text_buckets == [] and pipes[1].text_buckets == list(TEXT_BUCKETS)
    ((shape, mask, kwargs),) = seen
    assert shape[:2] == (2, TEXT_BUCKETS[0]) and "txt_lengths" not in kwargs
    assert mask.tolist() == [[i < n for i in range(TEXT_BUCKETS[0])] for n in lengths]
    for eager, padded in zip(*latents, strict=True):
        torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-4)
    texts = pipes[1].warmup_text_lengths()
    assert len(texts) == 3  # 128, 256, 512: what the default max_sequence_length (512) reaches
    for text, bucket in zip(texts, TEXT_BUCKETS, strict=False):
        for index in range(4):
            prompt = pipes[1].encode_prompt([_warmup_request((32, 32), index, text=text)]).prompt
            assert step_bucket(prompt.embeds.shape[1], pipes[1].text_buckets) == bucket


def _request(prompt: str, **params) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(num_inference_steps=2, seed=0, **params), "r")


def test_warm_up_runs_each_bucket_then_warns_on_serving_compiles(dist_world, qwen_image_dir, monkeypatch):
    """Request mode warms every bucket; step mode only the buckets one forward can hold; afterwards a forward
    that compiles logs a WARNING with its input shapes and is counted (Dynamo's counter isolated: on the CPU
    nothing compiles)."""
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    cpu = torch.device("cpu")
    pipe = QwenImagePipeline.from_pretrained(
        OmniDiffusionConfig(model=str(qwen_image_dir)), qwen_image_dir, cpu, torch.float32
    )
    assert warm_up(pipe, OmniDiffusionConfig(model="m", diffusion_warmup_shapes="64x64"), cpu) == ([], [])  # eager
    accelerate_transformer(pipe.transformer, compile_blocks=False, cuda_graphs=False)
    (forward,) = compiled_forwards(pipe)
    with torch.inference_mode():
        request_mode, peaks = warm_up(pipe, OmniDiffusionConfig(model="m", max_num_seqs=2,
                                                                diffusion_warmup_shapes="64x64"), cpu)
        assert peaks == []  # measured on CUDA only
        texts = pipe.warmup_text_lengths()
        assert [s.label for s in request_mode] == [
            f"64x64 batch {b} text {t}{g}" for b in (1, 2) for g in ("", " guided") for t in texts
        ]  # a negative prompt (true CFG) doubles the rows: a signature of its own
        forward.serving = False

        def tokens(size: int, text: int, batch: int) -> int:
            return sum(
                pipe.step_tokens(
                    pipe.prepare([_warmup_request((size, size), i, text=text)], StepContext(pipe.od_config))
                )
                for i in range(batch)
            )

        # A cap of 32x32's batch 2 with the shortest text: 64x64 runs alone, 32x32 co-batches 2 short prompts
        # only (3 states, or longer prompts, do not fit).
        cap = tokens(32, texts[0], 2)
        assert tokens(64, texts[0], 2) > cap and tokens(32, texts[1], 2) > cap and tokens(32, texts[0], 3) > cap
        step_mode, _ = warm_up(
            pipe,
            OmniDiffusionConfig(
                model="m",
                max_num_seqs=4,
                step_execution=True,
                diffusion_warmup_shapes="64x64,32x32",
                diffusion_max_tokens_per_forward=cap,
            ),
            cpu,
        )
        assert [s.label for s in step_mode] == [
            *(f"{size} batch 1 text {t}{g}" for size in ("64x64", "32x32") for g in ("", " guided") for t in texts),
            f"32x32 batch 2 text {texts[0]}",  # 2 guided states (twice the rows) exceed the cap
        ]
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
    stats = compile_mod.compile_stats(pipe)  # what the worker attaches to each output (/metrics)
    assert (stats.serving_compiles, stats.serving_captures, stats.compiles) == (6, 0, forward.compiles)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "compile while serving: 3 graph(s) compiled" in warnings[0]
    assert "arg0=1x4x64" in warnings[0]  # the batch rows and image tokens of the forward that compiled


@pytest.mark.cuda
def test_default_serve_config_is_compiled_on_cuda_and_warmed_up(dist_world, qwen_image_dir):
    """No flags on CUDA: the model runner loads the compiled path (DiT and VAE decoder) and warms up before it
    returns; a request of a warmed signature then neither compiles nor captures, one of a new size does (and is
    counted)."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    # A worker process holds one pipeline; this pytest process compiled other VAE decoders before (their `forward`
    # code is shared), and past Dynamo's recompile limit a code object runs eager: start from a fresh Dynamo.
    torch._dynamo.reset()
    od_config = _default_od_config("--max-num-seqs", "2", "--diffusion-warmup-shapes", "64x64")
    assert od_config.enforce_eager is False
    od_config.model = str(qwen_image_dir)
    runner = DiffusionModelRunner(od_config, torch.device("cuda", torch.cuda.current_device()))
    runner.load_model()
    forward, decoder = runner.pipeline.transformer.compiled_forward, runner.pipeline.vae.decoder.compiled_forward
    assert set(compiled_forwards(runner.pipeline)) == {forward, decoder}  # the DiT's, the VAE decoder's
    assert isinstance(forward, CompiledForward) and forward.serving and decoder.serving
    assert forward.compiles >= 1 and forward.captures >= 2  # batch 1 and batch 2
    assert decoder.compiles >= 1 and decoder.captures == 0  # compiled by the warm-up's decodes, no CUDA graph
    warmed = _warmup_request((64, 64), 0).prompt
    with torch.inference_mode():
        (out,) = runner.pipeline.forward(DiffusionRequestBatch([_request(warmed, height=64, width=64)]))
        assert out.error is None, out.error
        guided = {"prompt": warmed, "negative_prompt": "blurry"}  # true CFG (negative rows): warmed as well
        (out,) = runner.pipeline.forward(DiffusionRequestBatch([_request(guided, height=64, width=64)]))
        assert out.error is None, out.error
        assert (forward.serving_compiles, forward.serving_captures, decoder.serving_compiles) == (0, 0, 0)
        (out,) = runner.pipeline.forward(DiffusionRequestBatch([_request(warmed, height=32, width=32)]))
    assert out.error is None, out.error
    assert forward.serving_captures >= 1
