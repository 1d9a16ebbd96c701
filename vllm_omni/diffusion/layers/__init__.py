"""Shared DiT building blocks (adaptive norms, modulation, gating, RoPE, compile/graph helpers).

Every op here is plain torch so it runs on CPU as the reference path; on CUDA the same code is fused by
regional `torch.compile` (see `compile.py`) and replayed through CUDA graphs for static shapes.
"""
