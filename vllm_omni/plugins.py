"""vLLM plugin hook (entry point group `vllm.general_plugins`): registers our AR model classes (and the HF config
classes they need), lets an EngineCore fork its workers and leave without the interpreter's teardown, and lets a CPU
process use AMX.

vLLM calls this in every process it starts (API server, EngineCore, workers), so it must be idempotent and
cheap.
"""

import atexit
import multiprocessing
import os
import sys
from multiprocessing import util

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS


def register_models() -> None:
    from vllm import ModelRegistry

    from vllm_omni.models.qwen3_omni.compat import alias_qwen2_vl_image_processing

    alias_qwen2_vl_image_processing()  # vLLM's Qwen-VL/Omni models import torchvision-only code otherwise

    register_hf_configs()
    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in MODEL_REGISTRY.ar_models().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
    _fork_workers_in_engine_core()
    _exit_without_teardown_in_engine_core()
    _allow_amx_on_cpu()


def register_hf_configs() -> None:
    """The config classes of checkpoints transformers does not know (e.g. Qwen3-TTS's), so that vLLM and our
    config resolution read them with `AutoConfig` (idempotent)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from vllm_omni.catalog.spec import import_target

    for model_type, target in MODEL_REGISTRY.hf_configs().items():
        if model_type not in CONFIG_MAPPING:
            AutoConfig.register(model_type, import_target(target))


def _fork_workers_in_engine_core() -> None:
    """Our front end spawns EngineCores (it starts them from a thread of a multi-threaded process), and the
    `VLLM_WORKER_MULTIPROC_METHOD=spawn` it sets is inherited, so each EngineCore spawned its worker too: a fresh
    interpreter that re-imports torch and vLLM, 6-8 s of every AR stage start on CPU. vLLM loads plugins in the
    EngineCore before it starts its executor, while the EngineCore still runs one thread, where fork (vLLM's
    default) is safe; vLLM itself still switches to spawn where fork is not (CUDA initialized, Ray, NUMA bind).
    """
    if (multiprocessing.current_process().name.startswith("EngineCore")
            and os.environ.get(ENGINE_CORE_FORKS_WORKERS) == "1"):
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


def _exit_without_teardown_in_engine_core() -> None:
    """An EngineCore that stopped cleanly has torn itself down (workers joined, distributed state destroyed, heap
    collected); the interpreter's teardown after that collects and frees the ~700k objects of torch and vLLM once
    more, 2.9 CPU-s that free nothing the process exit does not. On a loaded 2-core machine that held every AR
    EngineCore past the API process's 10 s shutdown wait, into a SIGKILL. So, as `vllm serve ... --omni` and our
    diffusion processes do, it runs the exit handlers and leaves. Freezing the heap instead (what vLLM does after a
    clean ROCm shutdown) makes triton's nanobind print a leak report at every exit.

    The hook is multiprocessing's last exit finalizer, in a process multiprocessing started: it runs inside
    `BaseProcess._bootstrap` once `run` has ended, where the exception `run` ended with (if any) is still current.
    Only a clean stop (no exception, or `SystemExit` 0, vLLM's answer to SIGTERM) leaves early; a failure keeps its
    exit code and traceback.
    """
    if multiprocessing.current_process().name.startswith("EngineCore") and multiprocessing.parent_process():
        util.Finalize(None, _leave_if_stopped_cleanly, exitpriority=-100)


def _leave_if_stopped_cleanly() -> None:
    error = sys.exc_info()[1]
    if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _allow_amx_on_cpu() -> None:
    """Linux lets a process run AMX tile instructions only after it asked (arch_prctl XTILEDATA); vLLM CPU's
    kernels for short prefills use AMX without asking, so on an AMX CPU (Sapphire Rapids and later) the worker
    dies of SIGILL on a 1-3 token prompt. torch's `_init_amx` asks, once per process (a no-op answer False
    where the CPU has no AMX); every vLLM process runs this hook, forked or spawned."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import torch

        torch._C._cpu._init_amx()
