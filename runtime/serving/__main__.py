"""`python -m spmd_runtime.runtime.serving [CONFIG_JSON]`: run the HTTP front (normally started
by `spmdrun serve --http-port`, its config in SPMD_ENGINE_CONFIG) against the engine at the
config's rpc_address."""
import errno
import socket
import sys

from spmd_runtime.protocol.process_entry import config_of_this_process, exit_with_error
from spmd_runtime.runtime.log_format import configure_logging
from spmd_runtime.runtime.serving.app import serve_forever


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, bound as uvicorn binds (SO_REUSEADDR: a port left in
    TIME_WAIT by a stopped server is free)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


def main() -> None:
    config = config_of_this_process(sys.argv)
    configure_logging(config.log_level)
    where = f"[{config.http_host}]" if ":" in config.http_host else config.http_host
    try:
        listener = listen(config.http_host, config.http_port)
    except OSError as error:
        hint = "another server there? " if error.errno == errno.EADDRINUSE else ""
        exit_with_error(f"cannot listen on http://{where}:{config.http_port}: "
                        f"{error.strerror or error} ({hint}choose another with --http-port)")
    serve_forever(config, listener)


if __name__ == "__main__":
    main()
