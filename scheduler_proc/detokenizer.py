"""Incremental detokenization: turn a growing token list into text deltas without broken characters."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes the whole output each time and emits what is new.

    Text ending in U+FFFD is held back: the next token may complete a multi-byte character.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta
