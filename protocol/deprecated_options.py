"""Old spellings of engine options, removed: given on the command line or as an LLM keyword,
each is refused with one line naming the option that replaced it (one option per decision)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemovedOption:
    """An old option: its type on the command line (parsed only to be refused) and what
    replaced it."""

    name: str
    kind: type
    replacement: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


REMOVED_OPTIONS = {option.name: option for option in (
    RemovedOption("bucketing", str, "--execution-mode (on: bucketed, off: eager)"),
    RemovedOption("compile", bool, "--execution-mode compiled"),
    RemovedOption("enforce_eager", bool, "--execution-mode eager"),
    RemovedOption("async_scheduling", bool, "--step-pipelining (--no-async-scheduling: off)"),
    RemovedOption("overlap_steps", str, "--step-pipelining (on: overlap, off: schedule_ahead)"),
    RemovedOption("swap_space", float, "--kv-swap-memory with a unit (1.5GiB)"),
)}


def refuse_removed(names) -> None:
    """ValueError, one line, for the first removed option among `names` (field names)."""
    for name in names:
        option = REMOVED_OPTIONS.get(name)
        if option is not None:
            raise ValueError(f"{option.flag} was removed: use {option.replacement}")
