"""vLLM plugin hook (entry point group `vllm.general_plugins`): registers our AR model classes, and lets an
EngineCore fork its workers.

vLLM calls this in every process it starts (API server, EngineCore, workers), so it must be idempotent and
cheap.
"""

import multiprocessing
import os

from vllm_omni.catalog.registry import MODEL_REGISTRY


def register_models() -> None:
    from vllm import ModelRegistry

    from vllm_omni.models.qwen3_omni.compat import alias_qwen2_vl_image_processing

    alias_qwen2_vl_image_processing()  # vLLM's Qwen-VL/Omni models import torchvision-only code otherwise

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in MODEL_REGISTRY.ar_models().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
    _fork_workers_in_engine_core()


ENGINE_CORE_FORKS_WORKERS = "VLLM_OMNI_ENGINE_CORE_FORKS_WORKERS"
"""Set by our front end, beside the `VLLM_WORKER_MULTIPROC_METHOD=spawn` it chose, only when the user chose no
start method: an explicit `VLLM_WORKER_MULTIPROC_METHOD` is kept in every process. Internal, not a setting."""


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
