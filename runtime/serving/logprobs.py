"""OpenAI's logprobs objects, for chat completions and legacy completions, from the engine's
per-token records (TokenLogprobs: the chosen token first, then the top-k)."""
from __future__ import annotations

from collections.abc import Sequence

from spmd_runtime.protocol.logprobs import TokenLogprobs


class LogprobFormat:
    """Writes records in one endpoint's shape. Tokens are shown as their own decoded text;
    without a tokenizer as "token_id:<id>"."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._texts: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id]))
            self._texts[token_id] = text
        return text

    def choice(self, records: Sequence[TokenLogprobs], text_offset: int = 0) -> tuple[dict, int]:
        """The choice's `logprobs` object for these tokens, and the text offset after them
        (completions number each token by where its text starts in the choice's text)."""
        if self.chat:
            return {"content": [self._chat_entry(record) for record in records]}, text_offset
        tokens = [self.token(record.token_id) for record in records]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        # OpenAI's legacy shape: the top-k as {token: logprob}, the chosen token included.
        top = [{self.token(token_id): logprob
                for token_id, logprob in (*record.top, (record.token_id, record.logprob))}
               for record in records]
        return {"tokens": tokens, "token_logprobs": [record.logprob for record in records],
                "top_logprobs": top, "text_offset": offsets}, text_offset

    def _chat_entry(self, record: TokenLogprobs) -> dict:
        entry = self._entry(record.token_id, record.logprob)
        entry["top_logprobs"] = [self._entry(token_id, logprob)
                                 for token_id, logprob in record.top]
        return entry

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
