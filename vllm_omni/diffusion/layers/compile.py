"""Regional torch.compile: compile each repeated transformer block once, reuse it for every layer.

Compiling the block class (not the whole model) keeps compile time at one block's worth while Inductor fuses
the elementwise work around the GEMMs (adaLN modulation, gating, RoPE, GELU, q/k RMSNorm) into few kernels.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm_omni.diffusion.layers.cuda_graph import CUDAGraphRunner
from vllm_omni.logger import init_logger
from vllm_omni.outputs import CompileStats

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

logger = init_logger(__name__)


def compile_repeated_blocks(model: nn.Module, **compile_kwargs: Any) -> int:
    """`torch.compile` every submodule whose class is listed in `model._repeated_blocks`; returns how many."""
    names = set(getattr(model, "_repeated_blocks", ()))
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _repeated_blocks to compile")
    import torch._dynamo

    # Every layer instance must reuse its class's compiled graph, never hit the recompile limit.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # dynamic=None: the first shape compiles static; a second one (another prompt length or image size)
    # compiles once with symbolic sizes that serve all later shapes. Static graphs per shape would recompile
    # for every new prompt length; the symbolic graph measured within 1% of the static one (H200, Qwen-Image).
    options = {"fullgraph": True, "dynamic": None, **compile_kwargs}
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.compile(**options)
            count += 1
    return count


class AcceleratedForward:
    """What `accelerate_transformer` puts in `model.forward`: the compiled forward (through a CUDA graph per input
    signature when `runner` is set), counting the graphs Dynamo compiles and the CUDA graphs captured. Once
    `serving` is set (after the start-up warm-up), each call that compiles or captures logs a WARNING naming its
    input shapes: such a call stalls every request in its batch."""

    def __init__(self, forward: Callable[..., Any], runner: CUDAGraphRunner | None) -> None:
        self.forward = forward
        self.runner = runner
        self.serving = False
        self.compiles = 0
        self.captures = 0
        self.serving_compiles = 0
        self.serving_captures = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled, captured = dynamo_graphs(), self.runner.captures if self.runner is not None else 0
        start = time.perf_counter()
        out = (self.runner or self.forward)(*args, **kwargs)
        new_compiles = dynamo_graphs() - compiled
        new_captures = (self.runner.captures if self.runner is not None else 0) - captured
        self.compiles += new_compiles
        self.captures += new_captures
        if self.serving and (new_compiles or new_captures):
            self.serving_compiles += new_compiles
            self.serving_captures += new_captures
            logger.warning("compile while serving: %d graph(s) compiled, %d CUDA graph(s) captured "
                           "in %.2f s for inputs %s (add this shape to --diffusion-warmup-shapes)", new_compiles,
                           new_captures, time.perf_counter() - start, describe_inputs(args, kwargs))
        return out


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def describe_inputs(args: tuple, kwargs: dict[str, Any]) -> str:
    """`name=BxNxC` for every tensor argument (batch rows first), `name=value` for short other ones."""
    parts = [f"arg{i}" for i in range(len(args))]
    items = [*zip(parts, args, strict=True), *sorted(kwargs.items())]
    return ", ".join(f"{name}={'x'.join(map(str, value.shape))}" if isinstance(value, torch.Tensor)
                     else f"{name}={value!r}" for name, value in items if isinstance(value, torch.Tensor)
                     or len(repr(value)) <= 80)


def accelerate_transformer(model: nn.Module, *, compile_blocks: bool = True, cuda_graphs: bool = True,
                           compile_mode: str = "default") -> nn.Module:
    """Lossless speed-ups for a CUDA DiT: compiled repeated blocks, and the whole forward replayed as a CUDA
    graph per static input signature (one capture per image size / batch / text length bucket)."""
    if compile_blocks:
        compile_repeated_blocks(model, mode=compile_mode)
    runner = CUDAGraphRunner(model.forward) if cuda_graphs else None
    model.forward = AcceleratedForward(model.forward, runner)
    if runner is not None:
        apply = model._apply

        def _apply_and_drop_graphs(fn, *args, **kwargs):
            # `.to()` / `.cuda()` (e.g. sleep/wake) move the weights: graphs captured on the old addresses are void.
            runner.reset()
            return apply(fn, *args, **kwargs)

        model._apply = _apply_and_drop_graphs
    return model


def accelerated_forwards(module: Any) -> list[AcceleratedForward]:
    """The `AcceleratedForward`s of `module`'s submodules (its DiTs on the compiled path; [] when eager, and for
    a pipeline that is no `nn.Module`: the interface asks only for `forward`)."""
    if not isinstance(module, nn.Module):
        return []
    return [m.forward for m in module.modules() if isinstance(m.forward, AcceleratedForward)]


def compile_stats(module: Any) -> CompileStats | None:
    """The summed counts of `module`'s compiled forwards; None when it runs eager."""
    forwards = accelerated_forwards(module)
    if not forwards:
        return None
    return CompileStats(sum(f.compiles for f in forwards), sum(f.captures for f in forwards),
                        sum(f.serving_compiles for f in forwards), sum(f.serving_captures for f in forwards))


def configure_compile_cache(od_config: OmniDiffusionConfig) -> str:
    """Point Inductor's on-disk caches (FX graphs, AOTAutograd, Triton kernels) at the stage's cache directory,
    so that a restart loads the compiled blocks instead of compiling them; returns the directory. Called in the
    worker process before anything compiles."""
    import torch._functorch.config
    import torch._inductor.config
    from vllm import envs as vllm_envs

    path = od_config.diffusion_compile_cache_dir or os.path.join(vllm_envs.VLLM_CACHE_ROOT, "torch_compile_cache",
                                                                "diffusion")
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read by Inductor at each cache lookup, in this process only
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return path


def accelerate_decoder(vae: nn.Module, **compile_kwargs: Any) -> None:
    """The compiled path's VAE decode, lossless: the decoder's convolution weights in channels_last (cuDNN's
    native layout, so no NCHW <-> NHWC transpose runs around each convolution; skipped for 3-D convolutions) and
    its forward compiled whole (Inductor fuses the norms, activations and residual adds between convolutions).
    The forward is an `AcceleratedForward`, so the start-up warm-up's generations compile it (their decodes) and a
    compile while serving (a new size or batch) logs a WARNING as the DiT's do."""
    decoder = vae.decoder
    if all(p.dim() < 5 for p in decoder.parameters()):
        decoder.to(memory_format=torch.channels_last)
    # dynamic=None: a second batch size or image size compiles once more with symbolic sizes, then never again.
    options = {"dynamic": None, **compile_kwargs}
    decoder.forward = AcceleratedForward(torch.compile(decoder.forward, **options), None)


def accelerate_if_requested(model: nn.Module, od_config: OmniDiffusionConfig, device: torch.device, *,
                            cuda_graphs: bool = True) -> None:
    """`accelerate_transformer` when the stage runs compiled (`enforce_eager` False, the default on CUDA) and
    `model` runs on CUDA; elsewhere the model stays eager."""
    if not od_config.enforce_eager and device.type == "cuda":
        configure_compile_cache(od_config)
        accelerate_transformer(model, cuda_graphs=cuda_graphs)


def accelerate_vae_if_requested(pipeline: Any, od_config: OmniDiffusionConfig) -> bool:
    """`accelerate_decoder` on `pipeline.vae` when its DiT runs the compiled path (never eager, never on the CPU),
    the family declares its decoder compilable (`compile_vae_decoder`) and the VAE stays on the device (not
    `--enable-cpu-offload`, which moves it between decodes); whether it did."""
    if not getattr(pipeline, "compile_vae_decoder", False) or od_config.enable_cpu_offload \
            or not accelerated_forwards(pipeline):
        return False
    accelerate_decoder(pipeline.vae)
    return True
