"""`python -m spmd_runtime.launch ...` is `spmdrun ...`."""
import sys

from spmd_runtime.launch.cli import main

sys.exit(main())
