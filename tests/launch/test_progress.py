"""Progress of offline work: a tqdm bar on a terminal, a log line every tenth otherwise."""
from __future__ import annotations

import io
import logging

from spmd_runtime.launch.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_log_lines_when_not_a_terminal(caplog) -> None:
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="spmd.progress"):
        with Progress(100, "generate", stream=stream) as progress:
            for _ in range(100):
                progress.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"generate: {n}/100 done" for n in range(10, 101, 10)]
    assert stream.getvalue() == "", "nothing is drawn on a stream that is not a terminal"


def test_small_totals_log_each_item(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="spmd.progress"):
        with Progress(3, "bench", stream=io.StringIO()) as progress:
            for _ in range(3):
                progress.update()
    assert [r.getMessage() for r in caplog.records] == [f"bench: {n}/3 done" for n in (1, 2, 3)]


def test_a_bar_on_a_terminal(caplog) -> None:
    terminal = FakeTerminal()
    with caplog.at_level(logging.INFO, logger="spmd.progress"):
        with Progress(4, "generate", stream=terminal) as progress:
            for _ in range(4):
                progress.update()
    drawn = terminal.getvalue()
    assert "generate:" in drawn and "/4 [" in drawn and progress.done == 4
    assert not caplog.records, "a bar replaces the log lines"
