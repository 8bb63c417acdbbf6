"""An engine started by this launcher: its processes, their supervision, and a client to it."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import msgspec
import zmq
from spmd_runtime.launch.engine import start_engine, start_workers
from spmd_runtime.launch.node_agent import NodeAgent
from spmd_runtime.launch.supervisor import Child, ChildExited, JobEnded, Supervisor
from spmd_runtime.protocol.auth import framed
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.curve import rpc_server_key, socket_keys
from spmd_runtime.protocol.messages import WorkersLost
from spmd_runtime.protocol.transport import free_tcp_port, make_socket, private_ipc_address
from spmd_runtime.runtime.client import Client

RESTART_WINDOW_S = 3600.0

log = logging.getLogger("spmd.launch")


class RunningEngine:
    """Context manager: starts this node's processes, stops them all on exit, whatever happens."""

    def __init__(self, config: EngineConfig, *, private_rpc: bool = False) -> None:
        # A server's job is done when it is told to stop; private work (generate, bench) is not.
        self.serves = not private_rpc
        if private_rpc:
            config = msgspec.structs.replace(config, rpc_address=private_ipc_address("rpc"))
        self.supervisor = Supervisor()
        self.supervisor.install_signal_handlers()
        self.config = start_engine(config, self.supervisor)
        self.client: Client | None = None
        self.ready = False        # every worker loaded and the scheduler serving
        self.generation = 0
        self._restarts: list[float] = []
        self._gave_up = False
        self.agent: NodeAgent | None = None
        if self.config.nnodes > 1:          # node 0 decides on restarts across nodes
            self.agent = NodeAgent(self.config, self.supervisor,
                                   generation=0 if self.config.node_rank == 0 else -1)
            self.supervisor.on_exit = self.agent.worker_exited
        else:
            self.supervisor.on_exit = self._worker_exited

    def _worker_exited(self, child: Child, code: int) -> bool:
        """A worker died: kill the rest of this node's group and start a new generation, and
        tell the scheduler, which recomputes what was in flight. Past --max-restarts an hour
        (or across nodes, where one launcher cannot restart the whole group), tell the
        scheduler the engine is down and let the job stop."""
        if not child.name.startswith("worker") or self._gave_up:
            return False
        if self.config.node_rank == 0 and not self.ready:
            return False          # it failed before the engine ever served: a start-up error
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        reason = child.describe(code)
        final = len(self._restarts) >= self.config.max_restarts
        self._notify_scheduler(WorkersLost(generation=self.generation + 1, reason=reason,
                                           final=final))
        if final:
            self._gave_up = True
            log.error("%s; not restarting (%d restarts in the last hour, --max-restarts %d)",
                      reason, len(self._restarts), self.config.max_restarts)
            self._let_scheduler_fail_requests()
            return False
        self.supervisor.remove(lambda name: name.startswith("worker"))
        self.generation += 1
        self._restarts.append(now)
        log.warning("%s: restarting the worker group (restart %d of %d this hour)", reason,
                    len(self._restarts), self.config.max_restarts)
        start_workers(self.config, self.supervisor, self.generation,
                      master_port=free_tcp_port(self.config.master_addr))
        return True

    def _notify_scheduler(self, message: WorkersLost) -> None:
        """Over the workers' socket, with the auth token like a worker's frames."""
        ctx = zmq.Context()
        address = self.config.worker_address
        sock = make_socket(ctx, zmq.DEALER, address, bind=False,
                           identity=f"launcher-{self.config.node_rank}".encode(),
                           curve=socket_keys(self.config.curve_keys, address, server=False))
        sock.setsockopt(zmq.LINGER, 2000)
        try:
            sock.send_multipart(framed(self.config.auth_token, msgspec.msgpack.encode(message)))
        finally:
            sock.close()
            ctx.term()

    def _let_scheduler_fail_requests(self, timeout_s: float = 5.0) -> None:
        """The scheduler answers every request in flight with the error, then exits."""
        scheduler = next((c for c in self.supervisor.children if c.name == "scheduler"), None)
        if scheduler is None:
            return
        try:
            scheduler.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass              # stop_all takes care of it

    def alive(self) -> bool:
        if self.supervisor.stop_requested:
            return False
        try:
            self.supervisor.check()
        except (ChildExited, JobEnded):
            return False
        return True

    def connect(self) -> Client:
        """Wait until the engine serves (every worker loaded), then return a client of it."""
        self.client = Client(self.config.rpc_address, alive=self.alive,
                             auth_token=self.config.auth_token,
                             server_key=rpc_server_key(self.config))
        self.client.wait_ready()
        self.ready = True
        return self.client

    def __enter__(self) -> "RunningEngine":
        return self

    def __exit__(self, *exc) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.client is not None:
            self.client.close()
        self.supervisor.stop_all()

    def failure(self) -> tuple[str, int] | None:
        """The last line for a job that ends early, and its exit code; None if nothing failed
        and no stop was asked for. A child's failure names the child and its own reason (the
        one that caused it, not the scheduler that followed a worker); the code is 2 when that
        child reported a user error (exit code 2), else 1. A server stopped by SIGTERM exits
        cleanly (0); otherwise a stop by signal N is 128 + N (Ctrl-C: 130)."""
        if self.supervisor.stop_requested:
            signum = self.supervisor.stop_signal or signal.SIGTERM
            clean = self.serves and signum == signal.SIGTERM
            return "spmdrun: stopped by signal", 0 if clean else 128 + signum
        culprit = self.supervisor.culprit()
        if culprit is None:
            return None
        child, code = culprit
        return (f"spmdrun: error: {child.describe(code)}; stopped the whole job",
                2 if code == 2 else 1)


def exit_with_failure(engine: RunningEngine, error: BaseException) -> int:
    message, code = engine.failure() or (f"spmdrun: error: {error}", 1)
    print(message, file=sys.stderr, flush=True)
    return code
