"""HunyuanImage-2.1's cache presets (docs/cache.md): what `quality=high/fast` run on its transformer."""

from vllm_omni.diffusion.cache.policy import FamilyPresets

PRESETS = FamilyPresets(coefficients=(1.0, 0.0))
"""No published TeaCache calibration exists for HunyuanImage-2.1: the identity polynomial, so adaptive mode
accumulates the probe's raw relative L1 change (`quality=high/fast` are the fixed schedules and do not read it)."""
