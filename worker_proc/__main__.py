"""`python -m worker_proc CONFIG_JSON`: run one worker (rank from the torchrun environment)."""
import logging
import sys

from protocol.config import EngineConfig
from worker_proc.worker import run_worker

if __name__ == "__main__":
    config = EngineConfig.from_json(sys.argv[1])
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(config))
