"""Executors run scheduled batches on the diffusion workers."""
