"""`python -m spmd_runtime.scheduler_proc CONFIG_JSON`: the scheduler process (started by spmdrun)."""
import logging
import sys

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.scheduler_proc.server import serve

if __name__ == "__main__":
    config = EngineConfig.from_json(sys.argv[1])
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(serve(config))
