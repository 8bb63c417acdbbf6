"""`python -m spmd_runtime.worker_proc [CONFIG_JSON]`: run one worker (rank from the torchrun
environment), its config in SPMD_ENGINE_CONFIG as spmdrun starts it, or the argument (torchrun)."""
import logging
import os
import sys

from spmd_runtime.protocol.process_entry import config_of_this_process
from spmd_runtime.worker_proc.worker import run_worker

if __name__ == "__main__":
    config = config_of_this_process(sys.argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = run_worker(config)
    if code != 0:
        # A failed worker exits as before: across nodes, the launchers' reports of a peer's
        # death (the cause) reach the scheduler before this consequence is noticed.
        sys.exit(code)
    # Stopped cleanly, sockets and process group closed: skip the interpreter's teardown of
    # torch (0.4 s on a 2-core VM, every engine stop), with the logs flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
