"""Distributed layerwise offload (DLO) on CPU gloo ranks: each rank keeps 1/N of every offloaded block and
reassembles it (all-gather of the shards, or broadcast from the owning rank) just before it runs. Its world meets
over TCP as a multi-rank diffusion stage's does, and no rank listens on any address but the loopback one.

Why it matters: DLO must change where the weights live, never what a rank computes, while every rank runs its
OWN input. At 2 and 4 ranks the Qwen-Image, FLUX and Wan tiny DiTs (fp32; DLO moves nothing else), each rank with
its own random step input, give exactly the output of that rank's resident DiT (bit-equal, so PSNR is infinite),
twice in a row (the second pass after the cyclic prefetch), and each rank keeps 1/N of the offloaded bytes. The
wave rules (what a wave's requests must share) and the config rules are checked without ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.image_checks import psnr
from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.offload.distributed import dlo_wave_error
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

TRANSFORMERS = {
    "qwen-image": "vllm_omni.models.qwen_image.transformer:QwenImageTransformer2DModel",
    "flux": "vllm_omni.models.flux.transformer:FluxTransformer2DModel",
    "wan2.1-t2v": "vllm_omni.models.wan.transformer:WanTransformer3DModel",
}


def _inputs(family: str, model_dir: str, rank: int) -> tuple[tuple, dict]:
    """One denoise step's transformer inputs (2 rows, as CFG), drawn from this rank's own seed."""
    from types import SimpleNamespace

    from vllm_omni.diffusion.model_loader.diffusers_loader import read_component_config

    g = torch.Generator().manual_seed(100 + rank)
    cfg = SimpleNamespace(**{"guidance_embeds": False, **read_component_config(model_dir, "transformer")})
    if family == "qwen-image":
        return (
            torch.randn(2, 16, cfg.in_channels, generator=g),
            torch.randn(2, 5, cfg.joint_attention_dim, generator=g),
            None,
            torch.tensor([0.7, 0.7]),
            [(1, 4, 4)],
        ), {}
    if family == "flux":
        img_ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), dim=-1
        ).reshape(16, 3)
        args = (
            torch.randn(2, 16, cfg.in_channels, generator=g),
            torch.randn(2, 7, cfg.joint_attention_dim, generator=g),
            torch.randn(2, cfg.pooled_projection_dim, generator=g),
            torch.tensor([0.3, 0.9]),
        )
        guidance = torch.tensor([3.5, 3.5]) if cfg.guidance_embeds else None
        return args, dict(img_ids=img_ids, txt_ids=torch.zeros(7, 3), guidance=guidance)
    return (
        torch.randn(2, cfg.in_channels, 3, 8, 12, generator=g),
        torch.tensor([700.0, 700.0]),
        torch.randn(2, 20, cfg.text_dim, generator=g),
    ), {}


def _load(family: str, model_dir: str, od_config: OmniDiffusionConfig | None = None):
    """The DiT through the loader with `od_config`; None = resident, its linears' weights kept as parameters (as
    the offloaded loads keep them) so that sharding it in place moves them."""
    import importlib
    from pathlib import Path

    from vllm_omni.diffusion.model_loader.components import keep_linear_weights, load_native_transformer
    from vllm_omni.diffusion.model_loader.diffusers_loader import read_component_config
    from vllm_omni.diffusion.model_loader.dummy import load_native_weights

    module, name = TRANSFORMERS[family].split(":")
    cls = getattr(importlib.import_module(module), name)
    if od_config is not None:
        return load_native_transformer(
            cls, Path(model_dir), "transformer", od_config, torch.device("cpu"), torch.float32
        )
    model = cls.from_config(read_component_config(model_dir, "transformer"), prefix="transformer.")
    keep_linear_weights(model)
    load_native_weights(model, Path(model_dir), "transformer", "auto", torch.float32)
    return model.eval()


def _rank_main(rank: int, world: int, port: int, model_dirs: dict[str, str]) -> None:
    """Per family: this rank's resident output; the DiT sharded in place over this rank's pair (2 ranks); the DiT
    loaded with DLO over all `world` ranks (the loader's path). Two forwards each (the second after the cyclic
    prefetch of the first)."""
    from vllm.config import set_current_vllm_config

    from vllm_omni.diffusion.distributed.parallel_state import destroy_diffusion_distributed, init_diffusion_distributed
    from vllm_omni.diffusion.offload.distributed import apply_distributed_layerwise_offload
    from vllm_omni.diffusion.offload.layerwise import iter_offloaders

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    parallel = DiffusionParallelConfig(data_parallel_size=world)
    config = init_diffusion_distributed(
        rank=rank,
        world_size=world,
        parallel_config=parallel,
        device=cpu,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    pairs = [torch.distributed.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank makes every group
    # The world's rendezvous (rank 0's TCP store) and gloo's pairs listen on the init method's address only.
    assert not _listening_off_loopback(), _listening_off_loopback()
    try:
        with set_current_vllm_config(config), torch.inference_mode():
            for i, (family, model_dir) in enumerate(model_dirs.items()):
                model = _load(family, model_dir)
                args, kwargs = _inputs(family, model_dir, rank)
                expected = model(*args, **kwargs)
                # 2 ranks; FLUX runs the broadcast variant, Qwen-Image and Wan the all-gather one.
                use_allgather = family != "flux"
                offloader = apply_distributed_layerwise_offload(
                    model, cpu, pairs[rank // 2], resident_layers=i % 2, use_allgather=use_allgather
                )
                _check(model, args, kwargs, expected, offloader, rank, 2, use_allgather, family)
                # `world` ranks, through the loader: FLUX all-gathers here, the others broadcast.
                od_config = OmniDiffusionConfig(
                    model=model_dir,
                    dtype="float32",
                    parallel_config=parallel,
                    enable_distributed_layerwise_offload=True,
                    dlo_use_allgather=not use_allgather,
                    dlo_resident_layers=1 - i % 2,
                )
                model = _load(family, model_dir, od_config)
                (offloader,) = iter_offloaders(model)
                _check(model, args, kwargs, expected, offloader, rank, world, not use_allgather, family)
    finally:
        destroy_diffusion_distributed()


def _listening_off_loopback() -> list[tuple[str, int]]:
    import ipaddress

    import psutil

    return [(s.laddr.ip, s.laddr.port) for s in psutil.Process().net_connections(kind="inet")
            if s.status == psutil.CONN_LISTEN and not ipaddress.ip_address(s.laddr.ip).is_loopback]


def _check(model, args, kwargs, expected, offloader, rank: int, world: int, use_allgather: bool, family: str) -> None:
    assert offloader.num_offloaded >= 1 and expected.std() > 0, family
    assert all(slot.shape.numel() > 0 for p in offloader.packed for slots in p.slots.values() for slot in slots)
    for _ in range(2):
        torch.testing.assert_close(
            model(*args, **kwargs), expected, rtol=0, atol=0, msg=lambda m: f"{family} rank {rank}, {world} ranks: {m}"
        )
    total = offloader.bytes_per_pass()
    owned = sum(packed.nbytes() for i, packed in enumerate(offloader.packed) if i % world == rank % world)
    assert offloader.fetch.kept_bytes() == (total // world if use_allgather else owned), (family, world)


def test_dlo_ranks_each_run_their_own_input_equal_to_resident():
    """One gloo world of 4: DLO over all 4 ranks and over pairs of 2, every rank with its own input."""
    import torch.multiprocessing as mp
    from vllm.utils.network_utils import get_open_port

    from vllm_omni.catalog.tiny import build_tiny

    model_dirs = {family: str(build_tiny(family)) for family in TRANSFORMERS}
    mp.spawn(_rank_main, args=(4, get_open_port(), model_dirs), nprocs=4, join=True)


def _request(prompt: str = "a cat", rid: str = "r", **params) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), rid)


def test_wave_rules():
    assert dlo_wave_error([_request(rid="a"), _request("a dog", rid="b")]) is None
    # num_inference_steps None (the pipeline default) on both: compatible
    assert dlo_wave_error([_request(rid="a", seed=1), _request(rid="b", seed=2)]) is None
    for name, value in (
        ("num_inference_steps", 2),
        ("guidance_scale", 7.5),
        ("width", 1024),
        ("num_outputs_per_prompt", 2),
        ("extra_args", {"flow_shift": 3.0}),
        ("lora", {"name": "style", "path": "/x"}),
    ):
        error = dlo_wave_error([_request(rid="a"), _request(rid="b", **{name: value})])
        assert "compatible shape, CFG, denoise schedule, output count, and LoRA" in error.message, name
        assert error.status_code == 400
    assert (
        "compatible"
        in dlo_wave_error(
            [
                _request(rid="a"),
                OmniDiffusionRequest({"prompt": "a cat", "negative_prompt": "x"}, OmniDiffusionSamplingParams(), "b"),
            ]
        ).message
    )
    for empty in ("", {"prompt": ""}):
        error = dlo_wave_error([OmniDiffusionRequest(empty, OmniDiffusionSamplingParams(), "e"), _request(rid="ok")])
        assert "non-empty prompt" in error.message and error.param == "prompt"
    error = dlo_wave_error([_request(rid="a", quality="high"), _request(rid="b", quality="high")])
    assert "quality=high" in error.message and error.param == "quality"


def test_dlo_config_rules():
    def config(**kw):
        return OmniDiffusionConfig.from_kwargs(model="m", device="cpu", enable_distributed_layerwise_offload=True, **kw)

    assert config(data_parallel_size=2).enforce_eager is True
    for kwargs, message in (
        ({}, "--data-parallel-size >= 2"),
        (dict(data_parallel_size=2, tensor_parallel_size=2), "tensor / sequence"),
        (dict(data_parallel_size=2, step_execution=True), "--step-execution"),
        (dict(data_parallel_size=2, cache_backend="tea_cache"), "skip different blocks"),
        (dict(data_parallel_size=2, max_num_seqs=2), "one request per rank"),
        (dict(data_parallel_size=2, enable_layerwise_offload=True), "choose one"),
        (dict(data_parallel_size=2, dlo_resident_layers=-1), "must be >= 0"),
    ):
        with pytest.raises(OmniClientError, match=message):
            config(**kwargs)


@pytest.fixture(scope="module")
def dlo_engine():
    """A real engine on 2 CPU ranks: tiny Qwen-Image with DLO and LoRA on, waves of 2 filled within 2 s."""
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    config = OmniDiffusionConfig.from_kwargs(
        model=str(build_tiny("qwen-image")),
        dtype="float32",
        device="cpu",
        data_parallel_size=2,
        enable_distributed_layerwise_offload=True,
        request_batch_max_wait_ms=2000.0,
        enable_lora=True,
    )
    engine = DiffusionEngine(config)
    yield engine
    engine.close()
    assert all(not p.is_alive() for p in engine.executor.processes)


def _wave(engine, prompts: list, seeds: list[int], loras: list | None = None) -> list:
    sp = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=4.0)
    loras = loras or [None] * len(prompts)
    futures = [
        engine.submit(OmniDiffusionRequest(p, OmniDiffusionSamplingParams(seed=s, lora=lora, **sp), f"{s}"))
        for p, s, lora in zip(prompts, seeds, loras, strict=True)
    ]
    return [f.result(300) for f in futures]


def test_engine_runs_one_request_per_rank_and_refuses_a_bad_wave(dlo_engine, dist_world):
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    prompts = [{"prompt": "a red fox", "negative_prompt": "blurry"}, {"prompt": "a blue whale", "negative_prompt": "x"}]
    outs = _wave(dlo_engine, prompts, [1, 2])
    assert all(o.error is None for o in outs), [o.error for o in outs]
    resident = DiffusionModelRunner(
        OmniDiffusionConfig(model=str(build_tiny("qwen-image")), dtype="float32"), torch.device("cpu")
    )
    resident.load_model()
    sp = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=4.0)
    for out, prompt, seed in zip(outs, prompts, [1, 2], strict=True):
        request = OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(seed=seed, **sp), "ref")
        (expected,) = resident.pipeline.forward(DiffusionRequestBatch([request]))
        # The workers' processes run their own torch thread counts (GEMM blocking, so the last bit can differ
        # from this process's resident pipeline): the bar, PSNR >= 60 dB, on the decoded image.
        assert psnr(out.output[0], expected.output[0]) >= 60
    assert not np.array_equal(np.asarray(outs[0].output[0]), np.asarray(outs[1].output[0]))
    # An empty prompt fails its whole wave before dispatch (exactly two errors); the next wave still runs.
    bad = _wave(dlo_engine, [{"prompt": "", "negative_prompt": "x"}, prompts[0]], [3, 4])
    assert all(o.error is not None and "non-empty prompt" in o.error and o.error_status_code == 400 for o in bad)
    assert all(o.error is None for o in _wave(dlo_engine, prompts, [5, 6]))


def test_engine_runs_each_lora_adapter_set_in_its_own_wave(dlo_engine, dist_world, tmp_path):
    """Requests with and without an adapter submitted interleaved: the scheduler forms one wave per adapter set
    (a mixed wave would be refused whole, 400), and each output equals the resident pipeline's with that
    adapter: the LoRA hooks run on the all-gathered blocks."""
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    model = str(build_tiny("qwen-image"))
    lora = {"name": "a", "path": str(write_tiny_lora(model, tmp_path / "a.safetensors", rank=4, seed=1))}
    prompts = [{"prompt": f"a cat number {i}", "negative_prompt": "x"} for i in range(4)]
    loras = [lora, None, lora, None]
    outs = _wave(dlo_engine, prompts, [11, 12, 13, 14], loras)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    resident = DiffusionModelRunner(OmniDiffusionConfig(model=model, dtype="float32", enable_lora=True),
                                    torch.device("cpu"))
    resident.load_model()
    sp = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=4.0)
    for out, prompt, seed, adapter in zip(outs, prompts, [11, 12, 13, 14], loras, strict=True):
        request = OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(seed=seed, lora=adapter, **sp), "ref")
        (expected,) = resident.pipeline.forward(DiffusionRequestBatch([request]))
        assert psnr(out.output[0], expected.output[0]) >= 60  # as above
    plain = OmniDiffusionRequest(prompts[0], OmniDiffusionSamplingParams(seed=11, **sp), "plain")
    (without,) = resident.pipeline.forward(DiffusionRequestBatch([plain]))
    assert not np.array_equal(np.asarray(outs[0].output[0]), np.asarray(without.output[0]))  # the adapter acted
