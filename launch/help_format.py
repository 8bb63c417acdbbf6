"""How the command line reads and explains itself: no abbreviations, one-line errors, each
option's default in --help, and --help-all for the advanced options --help leaves out."""
from __future__ import annotations

import argparse
from typing import NoReturn

# Tuning knobs whose defaults serve almost everyone: out of --help, listed by --help-all (as
# vLLM's serve --help shows its option groups and --help=all everything).
ADVANCED_FIELDS = frozenset((
    "dummy_seed", "worker_address", "dist_backend", "dist_timeout_s",
    "row_parallel_chunk_threshold", "kv_admission_watermark", "prompt_bs_bucket",
    "prompt_seq_bucket", "decode_bs_bucket", "decode_seq_bucket", "graph_prompt_ratio",
    "graph_prompt_strategy", "graph_decode_strategy", "thermal_interval_steps",
    "thermal_hysteresis_c", "thermal_kp", "heartbeat_timeout_s", "rejoin_timeout_s",
    "max_message_bytes", "prompt_lookup_min", "prompt_lookup_max",
    "speculative_disable_by_batch_size", "row_parallel_chunks", "graph_reserved_mem",
    "thermal_victims", "kv_cache_huge_pages"))


class DefaultsShown(argparse.HelpFormatter):
    """--help shows each option's default, unless its help already tells it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is False
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class CommandLineParser(argparse.ArgumentParser):
    """No abbreviated options; a mistake is one line on stderr and exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"spmdrun: error: {message} (see {self.prog} --help)\n")


class HelpAll(argparse.Action):
    """--help-all: --help with the advanced options (ADVANCED_FIELDS) shown too."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        for action in parser._actions:
            action.help = getattr(action, "advanced_help", action.help)
        for group in parser._action_groups:
            group.description = None
        parser.print_help()
        parser.exit()
