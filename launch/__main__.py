"""`python -m launch ...` is `spmdrun ...`."""
import sys

from launch.cli import main

sys.exit(main())
