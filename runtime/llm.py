"""In-process API: LLM starts a private engine (launcher, scheduler, workers) and drives it."""
from __future__ import annotations

import difflib
import signal
import subprocess
from collections.abc import Mapping, Sequence

import msgspec
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.config_resolve import environment_options
from spmd_runtime.protocol.curve import rpc_server_key
from spmd_runtime.protocol.deprecated_options import refuse_removed
from spmd_runtime.protocol.process_entry import config_env
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.protocol.transport import private_ipc_address
from spmd_runtime.runtime.client import Client, Prompt
from spmd_runtime.runtime.outputs import RequestOutput
from spmd_runtime.runtime.preflight import check_config
from spmd_runtime.runtime.process import spawn_python


class LLM:
    """A local engine. `LLM(model, **engine_options)` takes any EngineConfig field as a keyword.

    Use as a context manager, or call shutdown(): no process outlives it.
    """

    def __init__(self, model: str = "smollm2", *, startup_timeout_s: float = 900.0,
                 **engine_options) -> None:
        refuse_removed(engine_options)
        _check_option_names(engine_options)
        engine_options = dict(engine_options)
        engine_options.setdefault("rpc_address", private_ipc_address("llm"))
        engine_options = {**environment_options(engine_options), **engine_options}
        # Refuse bad options here, naming the option, rather than in the launcher after a
        # process has started (the command line's path); then what needs no weights (the model
        # can be found, TP fits its heads, ports are free).
        try:
            self.config = EngineConfig.from_values({"model": model, **engine_options})
        except msgspec.ValidationError as error:
            raise ValueError(f"invalid engine option: {error}") from None
        check_config(self.config)
        self._process: subprocess.Popen | None = spawn_python(
            "spmd_runtime.launch", ["serve"], config_env(self.config), stdout=subprocess.DEVNULL)
        self._client = Client(self.config.rpc_address, alive=self._alive,
                              auth_token=self.config.auth_token,
                              server_key=rpc_server_key(self.config))
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
        """The model's tokenizer, loaded in this process on first use (generate and chat need
        none: the engine tokenizes and detokenizes)."""
        return self._client.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Complete each prompt (a string or a list of token ids); outputs keep the input order
        and carry their text (empty for a model without a tokenizer)."""
        return self._client.generate(prompts, params)

    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None,
             ) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts, or a string: one user
        message) or a list of conversations, answered after the model's chat template."""
        single = isinstance(messages, str) or (messages and isinstance(messages[0], Mapping))
        return self._client.generate([messages] if single else list(messages), params, chat=True)

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


def _check_option_names(options: dict) -> None:
    """ValueError naming an unknown option and the nearest valid one."""
    valid = [name for name in EngineConfig.__struct_fields__ if name != "model"]
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(name, [*valid, "startup_timeout_s"], n=1)
            hint = f"; did you mean {close[0]}?" if close else (
                "; LLM() takes the EngineConfig fields (the spmdrun flags with _ for -)")
            raise ValueError(f"unknown engine option {name!r}{hint}")
