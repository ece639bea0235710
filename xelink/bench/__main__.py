"""``python -m xelink.bench <name> [options]``: the same as ``xelink bench <name> [options]``."""
import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
