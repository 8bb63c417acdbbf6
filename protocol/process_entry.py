"""What the entry point of every engine process shares: the config handed over in the
environment (argv shows in `ps` to every user; the environment only to its owner) and a
start-up error reported as the one line the launcher relays."""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import NoReturn

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.env_vars import SPMD_ENGINE_CONFIG

CONFIG_ENV = SPMD_ENGINE_CONFIG
# A child's line starting so is its own account of why it exits; the launcher repeats it last.
ERROR_PREFIX = "spmdrun: error: "
# Failures a user fixes by changing the command (an option, a path): told in one line.
USER_ERRORS = (ValueError, FileNotFoundError)


def config_env(config: EngineConfig) -> dict[str, str]:
    """The environment entries that hand `config` to a child process."""
    return {CONFIG_ENV: config.to_json()}


def config_of_this_process(argv: list[str]) -> EngineConfig:
    """The config in argv[1] (by hand, or torchrun with the JSON as its argument), else in the
    environment, which is then cleared so that nothing this process starts inherits it."""
    if len(argv) > 1:
        return EngineConfig.from_json(argv[1])
    text = os.environ.pop(CONFIG_ENV, None)
    if text is None:
        exit_with_error(f"no engine config: set {CONFIG_ENV} to EngineConfig(...).to_json(), or "
                        "pass it as the only argument")
    return EngineConfig.from_json(text)


def report_error(message: str) -> None:
    """Why this process exits, as one line on stderr."""
    print(ERROR_PREFIX + " ".join(message.split()), file=sys.stderr, flush=True)


def report_failure(error: Exception, who: str, log: logging.Logger) -> tuple[int, str]:
    """Report an exception that ends this process: one line (who, and what), with the
    traceback logged too unless it is a user error. Returns the exit code (2 for a user
    error, else 1) and what to tell peers (the line, or the traceback)."""
    trace = traceback.format_exc()
    user_error = isinstance(error, USER_ERRORS)
    summary = str(error) if user_error else f"{type(error).__name__}: {error}"
    log.log(logging.DEBUG if user_error else logging.ERROR, "%s failed:\n%s", who, trace)
    report_error(f"{who} failed: {summary}")
    return (2, summary) if user_error else (1, trace)


def exit_with_error(message: str, code: int = 2) -> NoReturn:
    """report_error, then exit: 2 for a mistake the user can fix, 1 otherwise."""
    report_error(message)
    sys.exit(code)
