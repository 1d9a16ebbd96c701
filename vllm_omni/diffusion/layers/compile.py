"""Regional torch.compile: compile each repeated transformer block once, reuse it for every layer.

Compiling the block class (not the whole model) keeps compile time at one block's worth while Inductor fuses
the elementwise work around the GEMMs (adaLN modulation, gating, RoPE, GELU, q/k RMSNorm) into few kernels.
"""

from __future__ import annotations

import os
import time
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


class CompiledForward:
    """A module's forward on the compiled path, counting the graphs Dynamo compiles and the CUDA graphs captured
    while it runs. Once `serving` is set (after the start-up warm-up), each call that compiles or captures logs
    a WARNING naming its input shapes: such a call stalls every request in its batch.

    A DiT's is built by `accelerate_transformer` and called by the pipeline skeleton (`cache/runtime.py`
    `call_transformer`) in place of the module: it replays `type(module).forward` as a CUDA graph per input
    signature (`runner`), or calls the module (its compiled blocks inside). `module(...)` itself stays eager, so
    a path that must not replay a graph (TeaCache, cache-dit, a test's reference) simply calls the module. The
    VAE decoder, which diffusers calls, is compiled with `nn.Module.compile` and counted by forward hooks
    (`accelerate_decoder`). Either is found as the module's `compiled_forward` (`compiled_forwards`)."""

    def __init__(self, module: nn.Module, runner: CUDAGraphRunner | None) -> None:
        self.module = module
        self.runner = runner
        self.serving = False
        self.compiles = 0
        self.captures = 0
        self.serving_compiles = 0
        self.serving_captures = 0
        self._start: tuple[int, int, float] = (0, 0, 0.0)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.begin()
        out = (self.runner or self.module)(*args, **kwargs)
        self.end(args, kwargs)
        return out

    def begin(self) -> None:
        """Note the counters before a call."""
        self._start = (dynamo_graphs(), self.runner.captures if self.runner is not None else 0, time.perf_counter())

    def end(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Count what the call since `begin` compiled and captured; warn when it did while serving."""
        compiled, captured, start = self._start
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

    def drop_cuda_graphs(self) -> None:
        """Free the captured graphs: they read the weights at the addresses they had at capture, so whoever
        moves the module (sleep / wake) calls this; the next call of a signature captures it again."""
        if self.runner is not None:
            self.runner.reset()


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
                           compile_mode: str = "default") -> CompiledForward:
    """Lossless speed-ups for a CUDA DiT: compiled repeated blocks, and (`cuda_graphs`) the whole forward replayed
    as a CUDA graph per static input signature (one capture per image size / batch / text length bucket). Returns
    the `CompiledForward` the pipeline skeleton calls, also kept as `model.compiled_forward`; the class and its
    forward are untouched."""
    if compile_blocks:
        compile_repeated_blocks(model, mode=compile_mode)
    model.compiled_forward = CompiledForward(model, CUDAGraphRunner(model.forward) if cuda_graphs else None)
    return model.compiled_forward


def compiled_forward(module: nn.Module) -> CompiledForward | None:
    """`module`'s `CompiledForward` (None when it runs eager)."""
    compiled = module.__dict__.get("compiled_forward")
    return compiled if isinstance(compiled, CompiledForward) else None


def compiled_forwards(module: Any) -> list[CompiledForward]:
    """The `CompiledForward`s of `module`'s submodules (its DiTs and VAE decoder on the compiled path; [] when
    eager, and for a pipeline that is no `nn.Module`: the interface asks only for `forward`)."""
    if not isinstance(module, nn.Module):
        return []
    return [compiled for m in module.modules() if (compiled := compiled_forward(m)) is not None]


def call_compiled(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model`'s forward on the compiled path where it has one, else `model(*args, **kwargs)`."""
    return (compiled_forward(model) or model)(*args, **kwargs)


def compile_stats(module: Any) -> CompileStats | None:
    """The summed counts of `module`'s compiled forwards; None when it runs eager."""
    forwards = compiled_forwards(module)
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


def accelerate_decoder(vae: nn.Module, **compile_kwargs: Any) -> CompiledForward:
    """The compiled path's VAE decode, lossless: the decoder's convolution weights in channels_last (cuDNN's
    native layout, so no NCHW <-> NHWC transpose runs around each convolution; skipped for 3-D convolutions) and
    the decoder compiled whole (`nn.Module.compile`: Inductor fuses the norms, activations and residual adds
    between convolutions). diffusers calls the decoder itself, so its `CompiledForward` counts through forward
    hooks (run outside the compiled call): the start-up warm-up's generations compile it (their decodes) and a
    compile while serving (a new size or batch) logs a WARNING as the DiT's do."""
    decoder = vae.decoder
    if all(p.dim() < 5 for p in decoder.parameters()):
        decoder.to(memory_format=torch.channels_last)
    # dynamic=None: a second batch size or image size compiles once more with symbolic sizes, then never again.
    decoder.compile(**{"dynamic": None, **compile_kwargs})
    compiled = decoder.compiled_forward = CompiledForward(decoder, None)
    # Dynamo traces the hooks with the compiled call: disabled, they run eager before and after its graph.
    decoder.register_forward_pre_hook(torch.compiler.disable(lambda module, args, kwargs: compiled.begin()),
                                      with_kwargs=True)
    decoder.register_forward_hook(torch.compiler.disable(lambda module, args, kwargs, out: compiled.end(args, kwargs)),
                                  with_kwargs=True)
    return compiled


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
            or not compiled_forwards(pipeline):
        return False
    accelerate_decoder(pipeline.vae)
    return True
