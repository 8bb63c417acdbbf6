"""In-process API: LLM starts a private engine (launcher, scheduler, workers) and drives it."""
from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence

import msgspec
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.transport import private_ipc_address
from spmd_runtime.runtime.client import Client, Prompt
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.process import spawn_python
from spmd_runtime.scheduler_proc.chat import chat_prompt_ids


class LLM:
    """A local engine. `LLM(model, **engine_options)` takes any EngineConfig field as a keyword.

    Use as a context manager, or call shutdown(): no process outlives it.
    """

    def __init__(self, model: str = "smollm2", *, startup_timeout_s: float = 900.0,
                 **engine_options) -> None:
        engine_options.setdefault("rpc_address", private_ipc_address("llm"))
        try:
            config = EngineConfig(model=model, **engine_options)
        except TypeError as error:
            raise ValueError(f"unknown engine option: {error}") from None
        # The constructor checks no types or ranges; decoding does. Refuse bad options here,
        # naming the option, rather than in the launcher after a process has started.
        try:
            self.config = EngineConfig.from_json(config.to_json())
        except msgspec.ValidationError as error:
            raise ValueError(f"invalid engine option: {error}") from None
        self._process: subprocess.Popen | None = spawn_python(
            "spmd_runtime.launch", ["serve", "--config-json", self.config.to_json()],
            stdout=subprocess.DEVNULL)
        self._client = Client(self.config.rpc_address, alive=self._alive,
                              auth_token=self.config.auth_token)
        try:
            self._client.wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def client(self) -> Client:
        return self._client

    @property
    def tokenizer(self):
        return self._client.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids); outputs keep the input order."""
        return self._client.generate(prompts, params)

    def chat(self, messages, params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [chat_prompt_ids(self.tokenizer, c) for c in conversations]
        return self._client.generate(token_lists, params)

    def shutdown(self, timeout_s: float = 15.0) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        self._client.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_process", None) is not None:
            self.shutdown()
