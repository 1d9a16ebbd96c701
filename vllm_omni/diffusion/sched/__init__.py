"""Diffusion request scheduling: which waiting requests run together in the next forward."""

from vllm_omni.diffusion.sched.interface import RequestBatchSamplingParamsKey, build_request_batch_sampling_params_key
from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler

__all__ = ["RequestBatchSamplingParamsKey", "RequestScheduler", "build_request_batch_sampling_params_key"]
