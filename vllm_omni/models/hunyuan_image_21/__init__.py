"""HunyuanImage-2.1 (tencent/HunyuanImage-2.1, Diffusers layout): Qwen2.5-VL + ByT5 encoders -> MMDiT -> 32x VAE."""
