"""Process groups of the diffusion workers (vLLM's, so pipelines can use vLLM's parallel layers)."""
