"""Where a diffusion stage's weights live when the device cannot hold them all (docs/memory.md)."""
