"""Image comparison for the cache-quality benchmark: PSNR, SSIM and a side-by-side PNG.

SSIM is Wang et al. 2004 (11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03, on [0, 255] data) averaged over
channels and frames; scikit-image is not a dependency here, so it is computed with one depthwise convolution.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def as_frames(output) -> np.ndarray:
    """A pipeline output (PIL images, or a video dict of uint8 frames) as uint8 (N, H, W, C)."""
    value = output["video"] if isinstance(output, dict) else output
    if isinstance(value, list | tuple):
        value = np.stack([np.asarray(v) for v in value])
    value = np.asarray(value)
    if value.dtype != np.uint8:
        value = (np.clip(value, 0, 1) * 255).round().astype(np.uint8)
    return value.reshape(-1, *value.shape[-3:])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two uint8 (N, H, W, C) stacks."""
    x, y = (torch.from_numpy(v.astype(np.float64)).permute(0, 3, 1, 2) for v in (a, b))
    channels = x.shape[1]
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :]).expand(channels, 1, 11, 11)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window, groups=channels)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y = blur(x * x) - mu_x**2, blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    value = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(value.mean())


def save_side_by_side(frames: dict[str, np.ndarray], path: Path) -> None:
    """The first frame of each output, left to right in the given order."""
    from PIL import Image

    tiles = [f[0] for f in frames.values()]
    height = max(t.shape[0] for t in tiles)
    canvas = np.zeros((height, sum(t.shape[1] for t in tiles), 3), dtype=np.uint8)
    x = 0
    for tile in tiles:
        canvas[:tile.shape[0], x:x + tile.shape[1]] = tile[..., :3]
        x += tile.shape[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path)
