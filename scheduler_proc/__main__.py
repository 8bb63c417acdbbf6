"""`python -m spmd_runtime.scheduler_proc [CONFIG_JSON]`: the scheduler process, started by
spmdrun with its config in SPMD_ENGINE_CONFIG (by hand, the JSON may be the argument)."""
import errno
import logging
import sys

import zmq
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.process_entry import config_of_this_process, exit_with_error
from spmd_runtime.protocol.transport import BindError
from spmd_runtime.scheduler_proc.server import serve


def bind_failure(error: BaseException | None) -> BindError | None:
    """The BindError behind `error`, however it was re-raised."""
    while error is not None and not isinstance(error, BindError):
        error = error.__cause__ or error.__context__
    return error


def cannot_listen(failed: BindError, config: EngineConfig) -> str:
    """One line: which address, why, and the option that moves it."""
    if failed.address == config.rpc_address:
        option = "--rpc-address"
    else:                       # the workers' socket: tcp at --master-port + 1 across nodes
        option = "--master-port" if config.nnodes > 1 else "--worker-address"
    hint = "another server there? " if failed.errno == errno.EADDRINUSE else ""
    return f"{failed} ({hint}choose another with {option})"


def main() -> int:
    config = config_of_this_process(sys.argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve(config)
    except zmq.ZMQError as error:
        failed = bind_failure(error)
        if failed is None:
            raise
        exit_with_error(cannot_listen(failed, config))


if __name__ == "__main__":
    sys.exit(main())
