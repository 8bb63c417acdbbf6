"""`python -m spmd_runtime.worker_proc [CONFIG_JSON]`: run one worker (rank from the torchrun
environment), its config in SPMD_ENGINE_CONFIG as spmdrun starts it, or the argument (torchrun)."""
import logging
import sys

from spmd_runtime.protocol.process_entry import config_of_this_process
from spmd_runtime.worker_proc.worker import run_worker

if __name__ == "__main__":
    config = config_of_this_process(sys.argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(config))
