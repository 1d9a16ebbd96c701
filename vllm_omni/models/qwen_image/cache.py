"""Qwen-Image's cache presets (docs/cache.md): what `quality=high/fast` run on its transformer."""

from vllm_omni.diffusion.cache.policy import FamilyPresets

PRESETS = FamilyPresets(coefficients=(-4.5e2, 2.8e2, -4.5e1, 3.2, -2.0e-2))
"""TeaCache coefficients of ComfyUI-TeaCache for Qwen-Image (as vllm-omni ships them)."""
