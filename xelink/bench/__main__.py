"""``python -m xelink.bench <family> [options]``: the same as ``xelink bench <family> [options]``."""
import sys

from ..cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
