"""Wan's cache presets (docs/cache.md): TeaCache4Wan2.1's calibrations, timestep-embedding probe."""

from torch import nn

from vllm_omni.diffusion.cache.policy import FamilyPresets

PRESETS_1_3B = FamilyPresets(coefficients=(-5.21862437e4, 9.23041404e3, -5.28275948e2, 1.36987616e1, -4.99875664e-2))
PRESETS_14B = FamilyPresets(coefficients=(-3.03318725e5, 4.90537029e4, -2.65530556e3, 5.87365115e1, -3.15583525e-1))
WIDE = 5120
"""Transformer width from which the 14B calibration applies (Wan2.1 14B, Wan2.2 A14B)."""


def presets_for(transformer: nn.Module) -> FamilyPresets:
    return PRESETS_14B if transformer.config.inner_dim >= WIDE else PRESETS_1_3B
