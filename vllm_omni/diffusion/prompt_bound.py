"""The text encoder's token limit, checked in the API process before a diffusion request is queued.

A text encoder reads at most `max_prompt_tokens` tokens (the family spec's `DiffusionPipelineEntry`); diffusers
truncates longer prompts, after tokenizing all of them in the worker (a 50 MB prompt once took 110 s and 10 GB
there). Here a prompt longer than the limit is a 400 naming the field. The check costs at most one tokenization
of `max_prompt_tokens * longest token` characters: anything longer is refused from its length alone.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from vllm_omni.errors import OmniClientError


class PromptBound:
    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        # A token never stands for more characters than its own vocabulary entry has (byte-level BPE spells
        # every byte as one character; sentencepiece adds a leading "▁").
        self.max_chars = max_tokens * max(len(token) for token in tokenizer.get_vocab())
        self._lock = threading.Lock()  # a fast tokenizer is not safe to share across threads

    @classmethod
    def for_model(cls, model_dir: Path, tokenizer_subfolder: str, max_tokens: int) -> PromptBound:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir / tokenizer_subfolder), max_tokens)

    def too_long_by_length(self, text: str | None) -> bool:
        return text is not None and len(text) > self.max_chars

    def check(self, texts: dict[str, str | None]) -> None:
        """Raise `OmniClientError(param=<field>)` for the first text over the limit (call off the event loop)."""
        for param, text in texts.items():
            if text is None:
                continue
            if self.too_long_by_length(text):
                raise self._error(param, f"{len(text)} characters")
            with self._lock:
                count = len(self.tokenizer(text, add_special_tokens=False).input_ids)
            if count > self.max_tokens:
                raise self._error(param, f"{count} tokens")

    def _error(self, param: str, size: str) -> OmniClientError:
        return OmniClientError(f"{param} is {size}; this model's text encoder reads at most {self.max_tokens} "
                               "tokens", param=param)
