"""Old spellings of engine options, still accepted (command line and LLM keywords) with a
warning, and the one new option each maps onto."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeprecatedOption:
    """An old option: its type on the command line, the field that replaces it and how."""

    name: str
    kind: type
    choices: tuple[str, ...] | None
    field: str
    replacement: str


DEPRECATED_OPTIONS = {option.name: option for option in (
    DeprecatedOption("bucketing", str, ("auto", "on", "off"), "execution_mode",
                     "--execution-mode (on: bucketed, off: eager)"),
    DeprecatedOption("compile", bool, None, "execution_mode", "--execution-mode compiled"),
    DeprecatedOption("enforce_eager", bool, None, "execution_mode", "--execution-mode eager"),
    DeprecatedOption("async_scheduling", bool, None, "step_pipelining",
                     "--step-pipelining (--no-async-scheduling: off)"),
    DeprecatedOption("overlap_steps", str, ("auto", "on", "off"), "step_pipelining",
                     "--step-pipelining (on: overlap, off: schedule_ahead)"),
    DeprecatedOption("swap_space", float, None, "kv_swap_memory",
                     "--kv-swap-memory with a unit (1.5GiB)"),
)}
EXECUTION_ALIASES = ("bucketing", "compile", "enforce_eager")
PIPELINING_ALIASES = ("async_scheduling", "overlap_steps")


def replace_deprecated(values: dict) -> tuple[dict, list[str]]:
    """`values` (field name -> value) with every old spelling replaced by its new option, and
    one warning per old spelling given; ValueError for an old spelling given with its new
    option, or a value the old option did not take."""
    values = dict(values)
    old = {name: values.pop(name) for name in DEPRECATED_OPTIONS if name in values}
    for name, value in old.items():
        choices = DEPRECATED_OPTIONS[name].choices
        if choices and value not in choices:
            raise ValueError(f"invalid --{_flag(name)} {value!r}: choose from {', '.join(choices)}")
    warnings = [f"--{_flag(name)} is deprecated: use {DEPRECATED_OPTIONS[name].replacement}"
                for name in old]
    _replace(values, old, EXECUTION_ALIASES, "execution_mode", _execution_mode)
    _replace(values, old, PIPELINING_ALIASES, "step_pipelining", _step_pipelining)
    _replace(values, old, ("swap_space",), "kv_swap_memory",
             lambda given: int(float(given["swap_space"]) * 2**30))
    if values.get("admin_token") and not values.get("enable_admin"):
        values["enable_admin"] = True
        warnings.append("an admin token without --enable-admin is deprecated: add "
                        "--enable-admin (enable_admin=True) to accept admin calls")
    return values, warnings


def _replace(values: dict, old: dict, names: tuple[str, ...], new: str, mapping) -> None:
    given = {name: old[name] for name in names if name in old}
    if not given:
        return
    if new in values:
        raise ValueError(f"give --{_flag(new)} alone: {', '.join('--' + _flag(n) for n in given)} "
                         f"{'is' if len(given) == 1 else 'are'} its deprecated spelling")
    values[new] = mapping(given)


def _execution_mode(given: dict) -> str:
    """What --bucketing, --compile and --enforce-eager together used to run."""
    bucketing = given.get("bucketing", "auto")
    if given.get("enforce_eager"):
        return "bucketed" if bucketing == "on" else "eager"
    if given.get("compile"):
        return "eager" if bucketing == "off" else "compiled"
    return {"on": "bucketed", "off": "eager"}.get(bucketing, "auto")


def _step_pipelining(given: dict) -> str:
    """What --async-scheduling and --overlap-steps together used to run."""
    if not given.get("async_scheduling", True):
        return "off"
    return {"on": "overlap", "off": "schedule_ahead"}.get(given.get("overlap_steps"), "auto")


def _flag(name: str) -> str:
    return name.replace("_", "-")
