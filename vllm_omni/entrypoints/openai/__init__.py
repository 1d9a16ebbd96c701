"""The OpenAI-compatible HTTP server of vllm-omni (`vllm serve MODEL --omni`)."""
