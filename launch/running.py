"""An engine started by this launcher: its processes, their supervision, and a client to it."""
from __future__ import annotations

import logging
import sys

import msgspec

from launch.engine import start_engine
from launch.supervisor import ChildExited, Supervisor
from protocol.config import EngineConfig
from protocol.transport import private_ipc_address
from runtime.client import Client

log = logging.getLogger("spmd.launch")


class RunningEngine:
    """Context manager: starts this node's processes, stops them all on exit, whatever happens."""

    def __init__(self, config: EngineConfig, *, private_rpc: bool = False) -> None:
        if private_rpc:
            config = msgspec.structs.replace(config, rpc_address=private_ipc_address("rpc"))
        self.supervisor = Supervisor()
        self.supervisor.install_signal_handlers()
        self.config = start_engine(config, self.supervisor)
        self.client: Client | None = None

    def alive(self) -> bool:
        if self.supervisor.stop_requested:
            return False
        try:
            self.supervisor.check()
        except ChildExited:
            return False
        return True

    def connect(self) -> Client:
        """Wait until the engine serves (every worker loaded), then return a client of it."""
        self.client = Client(self.config.rpc_address, alive=self.alive,
                             auth_token=self.config.auth_token)
        self.client.wait_ready()
        return self.client

    def __enter__(self) -> "RunningEngine":
        return self

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        self.supervisor.stop_all()

    def failure_message(self) -> str:
        try:
            self.supervisor.check()
        except ChildExited as exited:
            return f"spmdrun: {exited}; stopped the whole job"
        if self.supervisor.stop_requested:
            return "spmdrun: stopped by signal"
        return ""


def exit_with_failure(engine: RunningEngine, error: BaseException) -> int:
    message = engine.failure_message() or f"spmdrun: {error}"
    print(message, file=sys.stderr, flush=True)
    return 130 if engine.supervisor.stop_requested and "signal" in message else 1
