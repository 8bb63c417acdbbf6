"""`python -m spmd_runtime.worker_proc CONFIG_JSON`: run one worker (rank from the torchrun environment)."""
import logging
import sys

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.worker_proc.worker import run_worker

if __name__ == "__main__":
    config = EngineConfig.from_json(sys.argv[1])
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(config))
