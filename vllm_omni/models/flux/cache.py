"""FLUX.1's cache presets (docs/cache.md): what `quality=high/fast` run on its transformer."""

from vllm_omni.diffusion.cache.policy import FamilyPresets

PRESETS = FamilyPresets(coefficients=(4.98651651e2, -2.83781631e2, 5.58554382e1, -3.82021401, 2.64230861e-1))
"""TeaCache coefficients of the TeaCache paper's FLUX calibration."""
