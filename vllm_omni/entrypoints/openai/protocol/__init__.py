"""Request/response models of the omni routes; vLLM's OpenAI models are reused and extended."""
