"""`python -m spmd_runtime.launch ...` is `spmdrun ...`. Started by LLM(...), `serve` takes its
config from SPMD_ENGINE_CONFIG (tokens included: the environment is private, argv is not)."""
import os
import sys

from spmd_runtime.launch.cli import main
from spmd_runtime.protocol.process_entry import CONFIG_ENV

argv = sys.argv[1:]
config_json = os.environ.pop(CONFIG_ENV, None)   # the children get theirs from the launcher
if config_json is not None and argv[:1] == ["serve"]:
    argv += ["--config-json", config_json]        # in this process only: not in its argv
sys.exit(main(argv))
