"""The model's tokenizer in the scheduler process: it tokenizes RPC clients' text and chat prompts
and decodes every output incrementally, so clients need neither transformers nor the model files.

It loads in a background thread started with the scheduler, overlapping the workers' loading.
A model without a tokenizer (dummy presets, bare weight directories) serves token ids only.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from spmd_runtime.protocol.messages import AddRequest
from spmd_runtime.protocol.model_source import resolve_model
from spmd_runtime.scheduler_proc.chat import chat_prompt_ids
from spmd_runtime.scheduler_proc.text_stream import TextStream
from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer

log = logging.getLogger("spmd.scheduler")


class ServedTokenizer:
    def __init__(self, model: str) -> None:
        self._tokenizer = None
        self._missing = ""            # why there is no tokenizer, once loading failed
        # Requests whose outputs are decoded, by id (only while the tokenizer exists).
        self._detokenizers: dict[int, TextStream] = {}
        self._thread = threading.Thread(target=self._load, args=(model,), name="tokenizer",
                                        daemon=True)
        self._thread.start()

    def _load(self, model: str) -> None:
        started = time.perf_counter()
        try:
            self._tokenizer = load_tokenizer(resolve_model(model))
        except ValueError as error:       # the model has none: say so to text prompts
            self._missing = str(error)
            log.info("%s: serving token-id prompts only, outputs without text", error)
        except Exception as error:        # broken files, no transformers: token ids still work
            self._missing = f"the tokenizer of {model} failed to load ({error!r}): pass token ids"
            log.warning("%s", self._missing)
        else:
            log.info("tokenizer loaded in %.1fs", time.perf_counter() - started)

    def wait(self, while_waiting: Callable[[], None]) -> None:
        """Until loading has ended, one way or the other; `while_waiting` runs between checks."""
        while self._thread.is_alive():
            while_waiting()
            self._thread.join(0.05)

    def missing(self) -> str | None:
        """Once loading has ended: None with a tokenizer, else why there is none."""
        self._thread.join()
        return None if self._tokenizer is not None else self._missing

    def loaded(self):
        """The tokenizer, once loading has ended; ValueError saying why there is none."""
        missing = self.missing()
        if missing is not None:
            raise ValueError(missing)
        return self._tokenizer

    def prompt_token_ids(self, message: AddRequest) -> list[int]:
        """The request's prompt as token ids; ValueError saying what is wrong with it."""
        if message.prompt is None and message.messages is None:
            return message.prompt_token_ids
        if message.prompt_token_ids or (message.prompt is not None and message.messages is not None):
            raise ValueError("give one prompt: token ids, a text (prompt) or a conversation "
                             "(messages), not several")
        tokenizer = self.loaded()
        if message.prompt is not None:
            return list(tokenizer(message.prompt).input_ids)
        conversation = [{"role": m.role, "content": m.content} for m in message.messages]
        if not conversation:
            raise ValueError("the conversation has no messages")
        try:
            return chat_prompt_ids(tokenizer, conversation)
        except ValueError:
            raise
        except Exception as error:        # template errors (jinja) say what is wrong
            raise ValueError(f"cannot apply the chat template: {error}") from None

    def start(self, request_id: int, stop: tuple[str, ...] = ()) -> None:
        """Decode this request's output from now on, cut at its stop strings (nothing happens
        without a tokenizer)."""
        if self._tokenizer is not None:
            self._detokenizers[request_id] = TextStream(self._tokenizer, stop)

    def text(self, request_id: int, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """The text these new tokens add to the request's output ("" when it is not decoded),
        and whether it reached a stop string: then it holds the text before it, and the request
        should end."""
        if not final:
            stream = self._detokenizers.get(request_id) if token_ids else None
        else:
            stream = self._detokenizers.pop(request_id, None)
        if stream is None:
            return "", False
        text = stream.add(token_ids, final)
        if stream.stopped:
            self._detokenizers.pop(request_id, None)
        return text, stream.stopped

    def forget(self, request_id: int) -> None:
        self._detokenizers.pop(request_id, None)
