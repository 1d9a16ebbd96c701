"""Diffusion worker processes: one per rank, each owning a device, process groups and a pipeline."""
