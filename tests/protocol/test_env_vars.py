"""The environment variable registry (protocol/env_vars.py): every SPMD_ variable the source
names is in it, and docs/CONFIGURATION.md shows it as it is."""
from __future__ import annotations

import re
from pathlib import Path

from spmd_runtime.protocol.env_vars import ENV_VARS, env_vars_table

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("protocol", "scheduler_proc", "worker_proc", "runtime", "launch", "bench")


def _source_files():
    for directory in SOURCE_DIRS:
        yield from (ROOT / directory).rglob("*.py")
    yield ROOT / "README.md"
    yield from (ROOT / "docs").glob("*.md")


def test_every_spmd_variable_named_in_the_source_is_registered() -> None:
    registered = {var.name for var in ENV_VARS}
    unknown = set()
    for path in _source_files():
        for name in re.findall(r"SPMD_[A-Z_]*[A-Z]", path.read_text(encoding="utf-8")):
            # Spelled as a template (SPMD_PROMPT_BS_BUCKET_{MIN,STEP,MAX}): a prefix of some.
            if name not in registered and not any(r.startswith(name) for r in registered):
                unknown.add(f"{name} ({path.relative_to(ROOT)})")
    assert not unknown, f"add to protocol/env_vars.py: {sorted(unknown)}"


def test_each_variable_is_registered_once_with_its_meaning_and_readers() -> None:
    names = [var.name for var in ENV_VARS]
    assert len(names) == len(set(names))
    assert all(var.meaning and var.read_by for var in ENV_VARS)


def test_the_configuration_doc_lists_the_registry() -> None:
    doc = (ROOT / "docs" / "CONFIGURATION.md").read_text(encoding="utf-8")
    assert env_vars_table() in doc, (
        "regenerate the table in docs/CONFIGURATION.md: python -c 'from "
        "spmd_runtime.protocol.env_vars import env_vars_table; print(env_vars_table())'")
