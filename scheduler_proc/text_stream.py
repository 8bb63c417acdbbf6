"""The text of one request's output as its tokens arrive, cut at the first stop string.

Stop strings are matched on the detokenized text, a string split across tokens included. Text
that could be the start of a stop string is held back until the next tokens decide it.
"""
from __future__ import annotations

from spmd_runtime.scheduler_proc.detokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = stop
        self._held = ""
        self.num_tokens = 0
        self.stopped = False    # a stop string was found: the request should end now

    def add(self, token_ids: list[int], final: bool) -> str:
        """Text that is ready to send; after a stop string, the text before it and nothing more."""
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        if self._detokenizer is None:
            return ""
        text = self._held + self._detokenizer.add(token_ids, final)
        self._held = ""
        if not self._stop:
            return text
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        if not final:
            keep = _longest_stop_prefix_suffix(text, self._stop)
            if keep:
                self._held = text[-keep:]
                return text[:-keep]
        return text


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that some stop string starts with."""
    for length in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in stops):
            return length
    return 0
