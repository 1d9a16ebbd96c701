"""FLUX.2 [klein] (black-forest-labs/FLUX.2-klein-4B and -base): Qwen3 encoder -> FLUX.2 MMDiT -> FLUX.2 VAE."""
