"""The diffusion stage's engine side: what decides, as opposed to the worker ranks that execute."""
