"""Serve any diffusers pipeline through the vllm-omni runtime (no request batching)."""
