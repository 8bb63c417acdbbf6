"""Spawning and supervising child processes: one dies, all stop; no orphans. Each child's
stderr passes through the launcher, which keeps the child's own account of a failure."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spmd_runtime.protocol.process_entry import ERROR_PREFIX
from spmd_runtime.runtime.process import spawn_python

__all__ = ["Child", "ChildExited", "JobEnded", "Supervisor", "spawn_python"]

# "<date> <time> ERROR <logger>: <message>" (runtime.log_format): a failure a child only logged.
ERROR_RECORD = re.compile(r"\S+ \S+ ERROR \S+: (.+)")


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    error: str = ""         # its own one-line account of why it exits (ERROR_PREFIX stripped)
    logged_error: str = ""  # else the first line of the last error it logged
    relay: threading.Thread | None = field(default=None, repr=False)
    relay_joined: bool = field(default=False, repr=False)

    def reason(self, wait_s: float = 1.0) -> str:
        """Why it exited, in its own words ("" if it said nothing); the first call after it
        exited waits up to wait_s for the rest of its stderr."""
        if self.relay is not None and not self.relay_joined and self.process.poll() is not None:
            self.relay.join(wait_s)
            self.relay_joined = True
        return self.error or self.logged_error

    def describe(self, code: int) -> str:
        reason = self.reason()
        return (f"{self.name} (pid {self.process.pid}) exited with code {code}"
                + (f": {reason}" if reason else ""))


def relay_stderr(child: Child) -> None:
    """Copy the child's stderr to ours line by line, keeping its error line (which the
    launcher repeats, naming the child, as its own last line) rather than printing it twice."""
    stream = child.process.stderr
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        if line.startswith(ERROR_PREFIX):
            child.error = line[len(ERROR_PREFIX):]
            continue
        logged = ERROR_RECORD.match(line)
        if logged:
            child.logged_error = logged.group(1)
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass                # nowhere to write: keep draining, or the child would block
    stream.close()


class ChildExited(RuntimeError):
    def __init__(self, child: Child, code: int) -> None:
        super().__init__(child.describe(code))
        self.child = child
        self.code = code


class JobEnded(RuntimeError):
    """Node 0 ended a multi-node job that failed (or went silent for good)."""


class Supervisor:
    def __init__(self) -> None:
        # Held while children are checked or replaced: across nodes, the launcher's node agent
        # replaces the workers from a thread of its own.
        self.lock = threading.RLock()
        # Set (to the reason) when node 0 ends the job; check() raises JobEnded.
        self.job_ended: str | None = None
        self.children: list[Child] = []
        self.stop_requested = False
        self.stop_signal: int | None = None
        # Set with stop_requested: wait() returns at once rather than at its next check.
        self._stopping = threading.Event()
        # Called with a child that exited and its code; True if it dealt with it (restarted).
        self.on_exit: Callable[[Child, int], bool] | None = None

    def add(self, name: str, process: subprocess.Popen) -> None:
        """Supervise `process`; started with stderr=PIPE, its stderr is relayed (relay_stderr)."""
        child = Child(name, process)
        if process.stderr is not None:
            child.relay = threading.Thread(target=relay_stderr, args=(child,), daemon=True,
                                           name=f"stderr of {name}")
            child.relay.start()
        self.children.append(child)

    def install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            self.stop_requested = True
            self.stop_signal = signum
            self._stopping.set()
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def exited(self) -> list[tuple[Child, int]]:
        """The children that have exited and their codes, workers before the scheduler: when a
        worker fails, the scheduler notices and exits too, and the worker is the cause."""
        codes = [(child, child.process.poll()) for child in self.children]
        exited = [(child, code) for child, code in codes if code is not None]
        return sorted(exited, key=lambda item: item[0].name == "scheduler")

    def check(self) -> None:
        """Raise ChildExited if any child has exited (unless on_exit dealt with it), JobEnded
        if node 0 ended the job."""
        if self.job_ended is not None:
            raise JobEnded(self.job_ended)
        with self.lock:
            exited = self.exited()
            if exited and self.on_exit is not None and not self.stop_requested:
                if self.on_exit(*exited[0]):
                    return
            if exited:
                raise ChildExited(*exited[0])

    def culprit(self, grace_s: float = 3.0) -> tuple[Child, int] | None:
        """The child whose exit ends the job, and its code: one that said why (its error line;
        it may still be on its way out), else one other than the scheduler, else the scheduler.
        A scheduler that exits on its own usually follows a worker that failed and is about
        to say so: wait up to grace_s for that."""
        deadline = time.monotonic() + grace_s
        while True:
            exited = self.exited()
            for child, _ in exited:
                child.reason()          # its stderr read to the end (within a second)
            told = sorted((c for c in self.children if c.error), key=lambda c: c.name == "scheduler")
            if told:
                try:
                    code = told[0].process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = told[0].process.poll()
                return told[0], code if code is not None else 1
            if not exited:
                return None
            if any(child.name != "scheduler" for child, _ in exited):
                return exited[0]
            if time.monotonic() > deadline or len(exited) == len(self.children):
                return exited[0]
            time.sleep(0.05)

    def wait_all_exited(self, timeout_s: float) -> int | None:
        """Wait up to timeout_s for every child to exit: the highest exit code, or None if
        some are still running."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for child in self.children:
            try:
                codes.append(child.process.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                return None
        return max(codes, default=0)

    def wait(self, until: Callable[[], bool] | None = None, interval_s: float = 0.2) -> None:
        """Supervise until `until()` is true or a stop is requested; raise if a child dies."""
        while not self.stop_requested and not (until and until()):
            self.check()
            self._stopping.wait(interval_s)

    def remove(self, names: Callable[[str], bool], timeout_s: float = 5.0) -> None:
        """SIGKILL the children whose name matches (they may be stuck in a collective with a
        dead peer: they are not waited on), reap them and forget them."""
        with self.lock:
            self._remove([child for child in self.children if names(child.name)], timeout_s)

    def _remove(self, doomed: list[Child], timeout_s: float) -> None:
        for child in doomed:
            if child.process.poll() is None:
                child.process.kill()
        for child in doomed:
            try:
                child.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.children = [child for child in self.children if child not in doomed]

    def stop_all(self, timeout_s: float = 10.0, first_grace_s: float = 5.0) -> None:
        """SIGTERM every child, wait, then SIGKILL whatever is left.

        The first child (the scheduler) goes first and gets a short grace period: it tells the
        workers to shut down, which is cleaner than killing them under its feet.
        """
        for index, child in enumerate(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
            if index == 0 and len(self.children) > 1:
                try:
                    child.process.wait(first_grace_s)
                except subprocess.TimeoutExpired:
                    pass
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        for child in self.children:     # the last of their output, before ours
            if child.relay is not None:
                child.relay.join(1.0)
