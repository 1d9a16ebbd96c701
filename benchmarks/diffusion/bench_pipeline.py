"""End-to-end text-to-image latency: our native pipelines vs diffusers' on the same components, same process.

Real-size components with random bf16 weights are built on the GPU (FLUX.1-dev: CLIP-L, T5-XXL, 11.9B MMDiT,
AutoencoderKL; Qwen-Image: Qwen2.5-VL-7B, 20.4B MMDiT, Qwen-Image VAE; Z-Image-Turbo: Qwen3-4B, 6B DiT, FLUX VAE,
9 steps; FLUX.2 klein 4B: Qwen3-4B, its MMDiT, FLUX.2 VAE, 4 steps; Qwen-Image-2.1: Qwen3-VL-8B, its DiT, its VAE,
40 steps with true CFG 4; HunyuanImage-2.1: Qwen2.5-VL-7B, ByT5-small, its 17B MMDiT, its 32x VAE, 50 steps with its
CFG/APG guider); tokenizers come from our tiny checkpoints. Text encoders and VAE are shared by both
pipelines; diffusers gets its own transformer and ours a copy of the same weights. Our pipeline runs eager, and with
`--accelerate` also with compiled blocks + CUDA graphs and (as a compiled stage) its compiled VAE decoder.
Two references on CUDA: diffusers eager, then (`--diffusers-compiled`, on by default) diffusers with its
transformer's repeated blocks compiled (`ModelMixin.compile_repeated_blocks`, what a user who knows diffusers
runs), after the same 2-step warm-up; each of our rows reports its speed-up against both.
`--smoke` runs the tiny checkpoints on the CPU.

`--quality lossless,high,fast` times our pipeline per request quality instead (docs/cache.md): same prompt and
seed, `--cache-backend` (default: none, so high / fast run TeaCache), compiled blocks + CUDA graphs on CUDA
(cached steps run without the graph); each row gives seconds, speed-up, PSNR and SSIM against `lossless` and
what the cache computed / reused, and `--png` shows the first image of each side by side. Random weights say
little about real image quality: PSNR / SSIM only show how far the cached output drifts.

  python benchmarks/diffusion/bench_pipeline.py --models flux qwen-image --size 1024 --out res.json
  python benchmarks/diffusion/bench_pipeline.py --models hunyuan-image-2.1 --size 1024 --out hunyuan_pipeline.json
  python benchmarks/diffusion/bench_pipeline.py --models qwen-image flux wan --quality lossless,high,fast \
      --out quality.json --png quality.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dit_forward import (  # noqa: E402
    CONFIGS,
    FLUX_CONFIG,
    QWEN_CONFIG,
    build_models,
    environment,
    set_attention_backend,
    sync,
    vllm_single_rank,
)
from quality_metrics import as_frames, psnr, save_side_by_side, ssim  # noqa: E402

from vllm_omni.diffusion.data import OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.layers.compile import accelerate_vae_if_requested  # noqa: E402
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402

PROMPT = "A photo of a cat sitting on a red chair in the morning light."
NEGATIVE = "blurry, low quality"


def image_psnr(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def _public(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def flux_components(device, dtype, smoke: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from vllm_omni.catalog.tiny import build_tiny

    tiny = build_tiny("flux")
    if smoke:
        from diffusers import FluxTransformer2DModel

        return dict(
            tokenizer=AutoTokenizer.from_pretrained(tiny / "tokenizer"),
            tokenizer_2=AutoTokenizer.from_pretrained(tiny / "tokenizer_2"),
            text_encoder=CLIPTextModel.from_pretrained(tiny / "text_encoder").to(device, dtype).eval(),
            text_encoder_2=T5EncoderModel.from_pretrained(tiny / "text_encoder_2").to(device, dtype).eval(),
            vae=AutoencoderKL.from_pretrained(tiny / "vae").to(device, dtype).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tiny / "scheduler"),
            transformer_config=_public(FluxTransformer2DModel.load_config(tiny / "transformer")),
        )
    tokenizer = AutoTokenizer.from_pretrained(tiny / "tokenizer")
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            text_encoder = CLIPTextModel(CLIPTextConfig(
                hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                projection_dim=768, hidden_act="quick_gelu", eos_token_id=tokenizer.eos_token_id))
            text_encoder_2 = T5EncoderModel(T5Config(
                vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True))
            vae = AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)
        finally:
            torch.set_default_dtype(torch.float32)
    return dict(
        tokenizer=tokenizer, tokenizer_2=AutoTokenizer.from_pretrained(tiny / "tokenizer_2"),
        text_encoder=text_encoder.eval(), text_encoder_2=text_encoder_2.eval(), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tiny / "scheduler"),
        transformer_config=FLUX_CONFIG,
    )


def qwen_components(device, dtype, smoke: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from vllm_omni.catalog.tiny import build_tiny

    tiny = build_tiny("qwen-image")
    scheduler_config = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
    base = dict(tokenizer=AutoTokenizer.from_pretrained(tiny / "tokenizer"), scheduler_config=scheduler_config,
                scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tiny / "scheduler"))
    if smoke:
        return dict(base,
                    text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny / "text_encoder")
                    .to(device, dtype).eval(),
                    vae=AutoencoderKLQwenImage.from_pretrained(tiny / "vae").to(device, dtype).eval(),
                    transformer_config=_public(QwenImageTransformer2DModel.load_config(tiny / "transformer")))
    config = AutoConfig.from_pretrained(tiny / "text_encoder")
    text = config.text_config
    real = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4)
    for key, value in real.items():
        setattr(text, key, value)
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[16, 24, 24])
    config.vision_config.out_hidden_size = 3584
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            text_encoder = Qwen2_5_VLForConditionalGeneration(config)
            vae = AutoencoderKLQwenImage(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                         attn_scales=[], temperal_downsample=[False, True, True])
        finally:
            torch.set_default_dtype(torch.float32)
    return dict(base, text_encoder=text_encoder.eval(), vae=vae.eval(), transformer_config=QWEN_CONFIG)


QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, layer_types=["full_attention"] * 36)
FLUX_VAE = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32)
FLUX2_VAE = dict(FLUX_VAE, latent_channels=32)
QWEN21_VAE: dict[str, Any] = {}
"""diffusers' `AutoencoderKLQwenImage21` defaults are the released VAE's."""


BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6)
HUNYUAN21_VAE = dict(latent_channels=64, block_out_channels=[128, 256, 512, 512, 1024, 1024], layers_per_block=2,
                     spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289)


def _qwen25_vl_7b(config) -> None:
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    config.text_config.layer_types = ["full_attention"] * 28
    config.text_config.rope_parameters = dict(config.text_config.rope_parameters, mrope_section=[16, 24, 24])
    config.vision_config.out_hidden_size = 3584


def _qwen3_vl_8b(config) -> None:
    text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    config.text_config.rope_parameters = dict(config.text_config.rope_parameters, mrope_section=[24, 20, 20])
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                  deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304)
    for key, value in vision.items():
        setattr(config.vision_config, key, value)


def component(cls, folder: Path, device, dtype, sizes):
    """`folder`'s component as is (`sizes` None: the tiny checkpoint's weights), or built at real size with random
    weights from its config updated by `sizes` (a dict, or a function editing a transformers config)."""
    if sizes is None:
        model = cls.from_pretrained(folder, dtype=dtype) if hasattr(cls, "config_class") else \
            cls.from_pretrained(folder, torch_dtype=dtype)
        return model.to(device).eval()
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            if hasattr(cls, "config_class"):  # transformers
                config = cls.config_class.from_pretrained(folder)
                if callable(sizes):
                    sizes(config)
                else:
                    for key, value in sizes.items():
                        setattr(config, key, value)
                model = cls(config)
            else:
                model = cls.from_config({**_public(cls.load_config(folder)), **sizes}) if sizes else cls()
        finally:
            torch.set_default_dtype(torch.float32)
    return model.eval()


def new_family_pipelines(name: str, device, dtype, smoke: bool):
    """(diffusers pipeline, our pipeline from a transformer, our transformer) for Z-Image, FLUX.2 klein,
    Qwen-Image-2.1 and HunyuanImage-2.1: encoders and VAE shared, the transformers with the same weights."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer

    from vllm_omni.catalog.tiny import build_tiny

    tiny = build_tiny({"z-image": "z-image-turbo"}.get(name, name))
    config = _public(json.loads((tiny / "transformer" / "config.json").read_text())) if smoke else CONFIGS[name]
    reference_tf, ours_tf = build_models(name, config, device, dtype)
    od_config = OmniDiffusionConfig(model=name, dtype=str(dtype).removeprefix("torch."))
    scheduler_config = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    common = dict(od_config=od_config, device=device, dtype=dtype, scheduler_config=scheduler_config)

    def real(sizes):
        return None if smoke else sizes

    if name == "z-image":
        from transformers import Qwen3Model

        from vllm_omni.models.z_image.pipeline import ZImagePipeline

        comps = dict(text_encoder=component(Qwen3Model, tiny / "text_encoder", device, dtype, real(QWEN3_4B)),
                     tokenizer=AutoTokenizer.from_pretrained(tiny / "tokenizer"),
                     vae=component(diffusers.AutoencoderKL, tiny / "vae", device, dtype, real(FLUX_VAE)))
        reference = diffusers.ZImagePipeline(scheduler=scheduler, transformer=reference_tf, **comps)
        return reference, lambda tf: ZImagePipeline(transformer=tf, **comps, **common), ours_tf
    if name == "flux2-klein":
        from transformers import Qwen3ForCausalLM

        from vllm_omni.models.flux2.pipeline import Flux2KleinPipeline

        comps = dict(text_encoder=component(Qwen3ForCausalLM, tiny / "text_encoder", device, dtype, real(QWEN3_4B)),
                     tokenizer=AutoTokenizer.from_pretrained(tiny / "tokenizer"),
                     vae=component(diffusers.AutoencoderKLFlux2, tiny / "vae", device, dtype, real(FLUX2_VAE)))
        reference = diffusers.Flux2KleinPipeline(scheduler=scheduler, transformer=reference_tf, is_distilled=True,
                                                 **comps)
        return reference, lambda tf: Flux2KleinPipeline(transformer=tf, is_distilled=True, **comps, **common), ours_tf
    if name == "hunyuan-image-2.1":
        from transformers import Qwen2_5_VLForConditionalGeneration, T5EncoderModel

        from vllm_omni.models.hunyuan_image_21.pipeline import HunyuanImagePipeline, MixGuidance

        comps = dict(text_encoder=component(Qwen2_5_VLForConditionalGeneration, tiny / "text_encoder", device, dtype,
                                            real(_qwen25_vl_7b)),
                     tokenizer=AutoTokenizer.from_pretrained(tiny / "tokenizer"),
                     text_encoder_2=component(T5EncoderModel, tiny / "text_encoder_2", device, dtype,
                                              real(BYT5_SMALL)),
                     tokenizer_2=AutoTokenizer.from_pretrained(tiny / "tokenizer_2"),
                     vae=component(diffusers.AutoencoderKLHunyuanImage, tiny / "vae", device, dtype,
                                   real(HUNYUAN21_VAE)))
        # The released guider is the class defaults (APG after step 5); the tiny one starts APG after step 1.
        guider_config = _public(json.loads((tiny / "guider" / "guider_config.json").read_text())) if smoke else {}
        reference = diffusers.HunyuanImagePipeline(
            scheduler=scheduler, transformer=reference_tf,
            guider=diffusers.AdaptiveProjectedMixGuidance(**guider_config), **comps)
        guider = MixGuidance(**guider_config)
        return reference, lambda tf: HunyuanImagePipeline(transformer=tf, guider=guider, ocr_guider=None, **comps,
                                                          **common), ours_tf
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    from vllm_omni.models.qwen_image_21.pipeline import QwenImage21Pipeline

    tokenizer = AutoTokenizer.from_pretrained(tiny / "processor")
    comps = dict(text_encoder=component(Qwen3VLForConditionalGeneration, tiny / "text_encoder", device, dtype,
                                        real(_qwen3_vl_8b)),
                 vae=component(diffusers.AutoencoderKLQwenImage21, tiny / "vae", device, dtype, real(QWEN21_VAE)))
    # Without torchvision the processor's video half cannot be built; diffusers' text-to-image path does not use it.
    check = Qwen3VLProcessor.check_argument_for_proper_class
    Qwen3VLProcessor.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        processor = Qwen3VLProcessor(AutoImageProcessor.from_pretrained(tiny / "processor"), tokenizer, None,
                                     chat_template=tokenizer.chat_template)
    finally:
        Qwen3VLProcessor.check_argument_for_proper_class = check
    reference = diffusers.QwenImage21Pipeline(scheduler=scheduler, transformer=reference_tf, processor=processor,
                                              **comps)
    vl_image_processor = AutoImageProcessor.from_pretrained(tiny / "processor")
    return reference, lambda tf: QwenImage21Pipeline(transformer=tf, tokenizer=tokenizer, sample_sigmas=None,
                                                     vl_image_processor=vl_image_processor, **comps, **common), ours_tf


NEW_FAMILIES = {
    # name: (default steps, true CFG scale or None, extra diffusers kwargs)
    "z-image": (9, None, {"guidance_scale": 0.0}),
    "flux2-klein": (4, None, {"guidance_scale": 1.0}),
    "qwen-image-2.1": (40, 4.0, {}),
    "hunyuan-image-2.1": (50, None, {}),  # CFG + APG through its guider, "" as the negative prompt on both sides
}


def build_ours_only(name: str, config: dict, device, dtype):
    """Our transformer alone, with the weights `build_models` gives it (diffusers' random init after seed 0): the
    diffusers transformer is built on the device, parked on the CPU while ours is built and loaded from it, then
    dropped, so that one transformer, not two, sits on the GPU (Qwen-Image's two 20.4B ones and its 8.3B text
    encoder do not fit an 80 GB card)."""
    from bench_dit_forward import _finish_load
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.manual_seed(0)
    with set_default_torch_dtype(dtype), torch.device(device):
        if name == "flux":
            from diffusers import FluxTransformer2DModel as Reference

            from vllm_omni.models.flux.transformer import FluxTransformer2DModel

            reference = Reference(**config).to("cpu")
            ours = FluxTransformer2DModel(**config)
        else:
            from diffusers import QwenImageTransformer2DModel as Reference

            from vllm_omni.models.qwen_image.transformer import QwenImageTransformer2DModel, QwenImageTransformerConfig

            reference = Reference(**config).to("cpu")
            ours = QwenImageTransformer2DModel(config=QwenImageTransformerConfig.from_dict(config))
    ours = _finish_load(ours, reference.to(dtype).eval())
    del reference
    return ours


def make_pipelines(name: str, device, dtype, smoke: bool, accelerate: bool, diffusers: bool = True):
    """(diffusers pipeline, our pipeline, our accelerated pipeline or None) sharing encoders and VAE.
    `diffusers=False` (FLUX and Qwen-Image only): no diffusers pipeline (None) and only our transformer built."""
    if name in NEW_FAMILIES:
        reference, ours_with, ours_tf = new_family_pipelines(name, device, dtype, smoke)
        reference.set_progress_bar_config(disable=True)
        return reference, ours_with, ours_tf
    comps = (flux_components if name == "flux" else qwen_components)(device, dtype, smoke)
    if diffusers:
        reference_tf, ours_tf = build_models(name, comps.pop("transformer_config"), device, dtype)
    else:
        reference_tf, ours_tf = None, build_ours_only(name, comps.pop("transformer_config"), device, dtype)
    od_config = OmniDiffusionConfig(model=name, dtype=str(dtype).removeprefix("torch."))
    if name == "flux":
        from diffusers import FluxPipeline as Reference

        from vllm_omni.models.flux.pipeline import FluxPipeline

        reference = None if reference_tf is None else Reference(transformer=reference_tf, **comps)

        def ours_with(transformer):
            return FluxPipeline(od_config=od_config, transformer=transformer, device=device, dtype=dtype, **comps)
    else:
        from diffusers import QwenImagePipeline as Reference

        from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

        scheduler_config = comps.pop("scheduler_config")
        reference = None if reference_tf is None else Reference(transformer=reference_tf, **comps)
        comps.pop("scheduler")

        def ours_with(transformer):
            return QwenImagePipeline(od_config=od_config, device=device, dtype=dtype, transformer=transformer,
                                     scheduler_config=scheduler_config, **comps)
    if reference is not None:
        reference.set_progress_bar_config(disable=True)
    return reference, ours_with, ours_tf


def run_once(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def forward_times(pipe, call) -> dict[str, float]:
    """Median GPU ms of the transformer calls one `call()` makes, by text length, and the whole call's step time
    not spent in them: where the denoise loop's time goes besides the forwards. Timed around the skeleton's
    transformer call (`cache.runtime.call_compiled`: the CUDA graph replay on the compiled path, which runs no
    module hook), swapped in for the duration of `call()`."""
    from vllm_omni.diffusion.cache import runtime

    inner, events = runtime.call_compiled, []

    def timed_call(model, *fargs, **fkwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = inner(model, *fargs, **fkwargs)
        end.record()
        if model is pipe.transformer:
            text = fkwargs.get("encoder_hidden_states", fargs[1] if len(fargs) > 1 else None)
            events.append((text.shape[1], start, end))
        return out

    runtime.call_compiled = timed_call
    try:
        out = call()
    finally:
        runtime.call_compiled = inner
    torch.cuda.synchronize()
    by_length: dict[int, list[float]] = {}
    for length, start, end in events:
        by_length.setdefault(length, []).append(start.elapsed_time(end))
    result = {f"forward_ms_text_{n}": float(np.median(v)) for n, v in sorted(by_length.items())}
    result["forwards"] = len(events)
    result["denoise_s"] = out.stage_durations.get("denoise")
    result["forward_sum_s"] = sum(start.elapsed_time(end) for _, start, end in events) / 1e3
    return result


def bench_model(name: str, args, device, dtype) -> list[dict[str, Any]]:
    if not args.diffusers and name not in ("flux", "qwen-image"):
        raise ValueError("--no-diffusers: FLUX and Qwen-Image only")
    reference, ours_with, ours_tf = make_pipelines(name, device, dtype, args.smoke, args.accelerate, args.diffusers)
    if args.attention_backend:
        set_attention_backend(ours_tf, args.attention_backend)
    default_steps, true_cfg, ref_extra = NEW_FAMILIES.get(name, (28 if name == "flux" else 50,
                                                                 4.0 if name == "qwen-image" else None, {}))
    steps = args.steps or default_steps
    cfg = {} if true_cfg is None else {"true_cfg_scale": true_cfg}
    kw = dict(height=args.size, width=args.size, num_inference_steps=steps, **cfg)

    def diffusers_call(num_steps=steps):
        extra = dict(ref_extra, **({"negative_prompt": NEGATIVE} if cfg else {}))
        return reference(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="pil",
                         **dict(kw, num_inference_steps=num_steps), **extra).images[0]

    def ours_call(pipe, num_steps=steps):
        prompt = {"prompt": PROMPT, "negative_prompt": NEGATIVE} if cfg else PROMPT
        sp = OmniDiffusionSamplingParams(seed=0, **dict(kw, num_inference_steps=num_steps))
        out = pipe.forward(DiffusionRequestBatch([OmniDiffusionRequest(prompt, sp, "bench")]))[0]
        if out.error:
            raise RuntimeError(out.error)
        return out

    rows = []
    with torch.inference_mode():
        ref_s = ref_img = compiled_s = None
        if reference is not None:
            diffusers_call(2)
            sync(device)
            ref_s, ref_img = run_once(diffusers_call)
            rows.append({"model": name, "pipeline": "diffusers", "size": args.size, "steps": steps, "s": ref_s,
                         **cfg})
            print(json.dumps(rows[-1]), flush=True)
        if reference is not None and args.diffusers_compiled and device.type == "cuda":
            reference.transformer.compile_repeated_blocks(fullgraph=True)
            t0 = time.perf_counter()
            diffusers_call(2)  # the compile, as our compiled variant's warm-up
            warm_s = time.perf_counter() - t0
            compiled_s, compiled_img = run_once(diffusers_call)
            rows.append({"model": name, "pipeline": "diffusers compile_repeated_blocks", "size": args.size,
                         "steps": steps, "s": compiled_s, **cfg, "speedup_vs_diffusers": ref_s / compiled_s,
                         "psnr_vs_diffusers": image_psnr(compiled_img, ref_img), "warmup_s": warm_s})
            print(json.dumps(rows[-1]), flush=True)
        variants, eager_img = [("ours eager", ours_tf)], None
        if args.accelerate and device.type == "cuda":
            variants.append(("ours compiled + CUDA graph", None))
        for label, transformer in variants:
            if transformer is None:
                from vllm_omni.diffusion.layers.compile import accelerate_transformer

                accelerate_transformer(ours_tf)
                transformer = ours_tf
            pipe = ours_with(transformer)
            # As a compiled stage does (the model runner): the VAE decoder too. The VAE is shared with diffusers,
            # whose rows ran before; diffusers' compiled reference compiles its transformer only.
            accelerate_vae_if_requested(pipe, pipe.od_config)
            t0 = time.perf_counter()
            ours_call(pipe, 2)
            warm_s = time.perf_counter() - t0
            secs, out = run_once(lambda pipe=pipe: ours_call(pipe))
            eager_img = out.output[0] if eager_img is None else eager_img
            rows.append({"model": name, "pipeline": label, "size": args.size, "steps": steps, "s": secs, **cfg,
                         "speedup_vs_diffusers": None if ref_s is None else ref_s / secs,
                         "psnr_vs_diffusers": None if ref_img is None else image_psnr(out.output[0], ref_img),
                         "speedup_vs_diffusers_compiled": None if compiled_s is None else compiled_s / secs,
                         "psnr_vs_ours_eager": image_psnr(out.output[0], eager_img),
                         "stage_durations": out.stage_durations, "warmup_s": warm_s})
            if args.forward_times and device.type == "cuda":
                rows[-1]["forward_times"] = forward_times(pipe, lambda pipe=pipe: ours_call(pipe))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def quality_pipeline(name: str, args, device, dtype):
    """Our pipeline for the quality runs (the diffusers reference is dropped) and its request kwargs."""
    if name == "wan":
        from bench_wan import WAN21_13B, build_pipelines, build_transformers

        from vllm_omni.catalog.tiny import build_tiny

        config = WAN21_13B
        if args.smoke:
            config = _public(json.loads((build_tiny("wan2.1-t2v") / "transformer" / "config.json").read_text()))
        _, ours = build_transformers(config, device, dtype)
        _, pipe = build_pipelines(args, device, dtype, None, ours)
        size = (48, 32) if args.smoke else (832, 480)
        kwargs = dict(width=size[0], height=size[1], num_frames=9 if args.smoke else 33, guidance_scale=5.0)
        prompt = PROMPT
    else:
        _, ours_with, ours_tf = make_pipelines(name, device, dtype, args.smoke, args.accelerate)
        pipe = ours_with(ours_tf)
        cfg = {"true_cfg_scale": 4.0} if name == "qwen-image" else {}
        kwargs = dict(height=args.size, width=args.size, **cfg)
        prompt = {"prompt": PROMPT, "negative_prompt": NEGATIVE} if cfg else PROMPT
    if args.accelerate and device.type == "cuda":
        from vllm_omni.diffusion.layers.compile import accelerate_transformer

        accelerate_transformer(pipe.transformer, cuda_graphs=name != "wan")
    pipe.od_config = dataclasses.replace(pipe.od_config, cache_backend=args.cache_backend)
    return pipe, prompt, kwargs


def bench_quality(name: str, args, device, dtype) -> list[dict[str, Any]]:
    pipe, prompt, kwargs = quality_pipeline(name, args, device, dtype)
    steps = args.steps or {"flux": 28}.get(name, 50)
    qualities = ["lossless"] + [q for q in args.quality if q != "lossless"]

    def call(quality: str, num_steps: int):
        sp = OmniDiffusionSamplingParams(seed=0, num_inference_steps=num_steps, quality=quality, **kwargs)
        sync(device)
        start = time.perf_counter()
        out = pipe.forward(DiffusionRequestBatch([OmniDiffusionRequest(prompt, sp, f"bench-{quality}")]))[0]
        sync(device)
        if out.error:
            raise RuntimeError(out.error)
        return time.perf_counter() - start, out

    rows, frames = [], {}
    with torch.inference_mode():
        for quality in qualities:
            call(quality, min(steps, 4))  # warm-up (compiles, captures the lossless graph)
            secs, out = call(quality, steps)
            frames[quality] = as_frames(out.output)
            base = rows[0]["s"] if rows else secs
            rows.append({"model": name, "quality": quality, "backend": out.extra["cache"]["backend"],
                         "steps": steps, "s": secs, "speedup_vs_lossless": base / secs,
                         "time_vs_lossless": secs / base, "psnr_vs_lossless": psnr(frames[quality], frames["lossless"]),
                         "ssim_vs_lossless": ssim(frames[quality], frames["lossless"]), "cache": out.extra["cache"],
                         "stage_durations": out.stage_durations, "random_weights": True, **kwargs})
            print(json.dumps(rows[-1], default=str), flush=True)
    if args.png:
        save_side_by_side(frames, args.png.with_name(f"{args.png.stem}_{name}{args.png.suffix}"))
    return rows


def print_quality_table(rows: list[dict[str, Any]]) -> None:
    print("\nrandom weights: PSNR / SSIM vs lossless show drift only, not real image quality")
    print(f"{'model':<15}{'quality':<10}{'backend':<11}{'steps':>6}{'s':>9}{'x lossless':>11}{'PSNR':>8}"
          f"{'SSIM':>8}{'reused':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<15}error: {r['error'][:90]}")
            continue
        cache = r["cache"]
        print(f"{r['model']:<15}{r['quality']:<10}{r['backend']:<11}{r['steps']:>6}{r['s']:>9.2f}"
              f"{r['time_vs_lossless']:>11.3f}{r['psnr_vs_lossless']:>8.1f}{r['ssim_vs_lossless']:>8.4f}"
              f"{cache['reused_steps']:>4}/{cache['reused_steps'] + cache['computed_steps']:<3}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["flux", "qwen-image"],
                        choices=["flux", "qwen-image", *NEW_FAMILIES, "wan"],
                        help="wan (Wan2.1-T2V-1.3B, 33 frames 832x480) only with --quality")
    parser.add_argument("--quality", type=lambda s: s.split(","), default=None,
                        help="comma-separated request qualities to time against lossless, e.g. lossless,high,fast")
    parser.add_argument("--cache-backend", default="none", choices=["none", "tea_cache", "cache_dit"],
                        help="the server backend of --quality runs (none: high / fast use tea_cache)")
    parser.add_argument("--png", type=Path, default=None, help="--quality: side-by-side PNG per model")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=None,
                        help="default: 28 (FLUX), 50 (Qwen-Image, true CFG 4), NEW_FAMILIES' for the others")
    parser.add_argument("--accelerate", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--attention-backend", default=None, help="our attention backend (e.g. CUDNN_ATTN)")
    parser.add_argument("--diffusers-compiled", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: also time diffusers with compile_repeated_blocks (a second reference)")
    parser.add_argument("--diffusers", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-diffusers: our rows alone, no diffusers pipeline or transformer built (FLUX and "
                             "Qwen-Image; Qwen-Image's two transformers and text encoder do not fit an 80 GB card)")
    parser.add_argument("--forward-times", action="store_true",
                        help="one more run of ours timing each transformer call (GPU events) against the denoise time")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if "wan" in args.models and not args.quality:
        parser.error("--models wan needs --quality")
    if args.smoke:
        args.size, args.steps = 64, args.steps or 2
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    env = environment(device)
    print(json.dumps(env), flush=True)
    rows: list[dict[str, Any]] = []
    with vllm_single_rank(device):
        for name in args.models:
            try:
                rows += (bench_quality if args.quality else bench_model)(name, args, device, dtype)
            except Exception as exc:  # keep the other model's numbers
                import traceback

                traceback.print_exc()
                rows.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result = {"command": " ".join(sys.argv), "env": env, "rows": rows}
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.quality:
        print_quality_table(rows)
        return {"command": " ".join(sys.argv), "env": env, "rows": rows}
    print(f"\n{'model':<15}{'pipeline':<34}{'size':>6}{'steps':>6}{'s/image':>9}{'x diff':>8}{'x comp':>8}{'PSNR':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<15}error: {r['error'][:90]}")
            continue
        vs_compiled = r.get("speedup_vs_diffusers_compiled")
        vs_diffusers, psnr_row = r.get("speedup_vs_diffusers", 1.0), r.get("psnr_vs_diffusers", float("inf"))
        print(f"{r['model']:<15}{r['pipeline']:<34}{r['size']:>6}{r['steps']:>6}{r['s']:>9.2f}"
              f"{'-' if vs_diffusers is None else f'{vs_diffusers:.2f}':>8}"
              f"{'-' if vs_compiled is None else f'{vs_compiled:.2f}':>8}"
              f"{'-' if psnr_row is None else f'{psnr_row:.1f}':>7}")
    return {"command": " ".join(sys.argv), "env": env, "rows": rows}


if __name__ == "__main__":
    main()
