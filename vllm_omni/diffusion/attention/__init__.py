"""Attention for diffusion transformers: one layer, backends chosen once per model build."""
