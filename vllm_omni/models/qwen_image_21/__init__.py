"""Qwen-Image-2.1: Qwen3-VL prompt encoder -> single-stream block-causal DiT with a per-request prefix K/V."""
