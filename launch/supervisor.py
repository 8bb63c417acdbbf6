"""Spawning and supervising child processes: one dies, all stop; no orphans."""
from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from spmd_runtime.runtime.process import spawn_python

__all__ = ["Child", "ChildExited", "Supervisor", "spawn_python"]

@dataclass
class Child:
    name: str
    process: subprocess.Popen


class ChildExited(RuntimeError):
    def __init__(self, child: Child, code: int) -> None:
        super().__init__(f"{child.name} (pid {child.process.pid}) exited with code {code}")
        self.child = child
        self.code = code


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stop_requested = False
        # Called with a child that exited and its code; True if it dealt with it (restarted).
        self.on_exit: Callable[[Child, int], bool] | None = None

    def add(self, name: str, process: subprocess.Popen) -> None:
        self.children.append(Child(name, process))

    def install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            self.stop_requested = True
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def check(self) -> None:
        """Raise ChildExited if any child has exited, naming a worker before the scheduler:
        when a worker fails, the scheduler notices and exits too, and the worker is the cause."""
        exited = [(child, child.process.poll()) for child in self.children]
        exited = [(child, code) for child, code in exited if code is not None]
        if exited and self.on_exit is not None and not self.stop_requested:
            child, code = min(exited, key=lambda item: item[0].name == "scheduler")
            if self.on_exit(child, code):
                return
        if exited:
            exited.sort(key=lambda item: item[0].name == "scheduler")
            raise ChildExited(*exited[0])

    def wait(self, until: Callable[[], bool] | None = None, interval_s: float = 0.2) -> None:
        """Supervise until `until()` is true or a stop is requested; raise if a child dies."""
        while not self.stop_requested and not (until and until()):
            self.check()
            time.sleep(interval_s)

    def remove(self, names: Callable[[str], bool], timeout_s: float = 5.0) -> None:
        """SIGKILL the children whose name matches (they may be stuck in a collective with a
        dead peer: they are not waited on), reap them and forget them."""
        doomed = [child for child in self.children if names(child.name)]
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
