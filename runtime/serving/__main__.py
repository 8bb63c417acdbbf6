"""`python -m spmd_runtime.runtime.serving CONFIG_JSON`: run the HTTP front (normally started by
`spmdrun serve --http-port`) against the engine at the config's rpc_address."""
import sys

from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime.log_format import configure_logging
from spmd_runtime.runtime.serving.app import serve_forever

if __name__ == "__main__":
    config = EngineConfig.from_json(sys.argv[1])
    configure_logging(config.log_level)
    serve_forever(config)
