"""Native Qwen-Image (text-to-image) and Qwen-Image-Edit pipelines."""
