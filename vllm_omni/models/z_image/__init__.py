"""Z-Image (Tongyi-MAI/Z-Image-Turbo): Qwen3 text encoder -> single-stream DiT -> FLUX VAE."""
