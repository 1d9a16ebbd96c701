"""Weight discovery and streaming for diffusers-format checkpoints."""
