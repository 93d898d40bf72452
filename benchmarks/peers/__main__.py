"""``python -m benchmarks.peers``: see `benchmarks.peers.cli`."""

import sys

from benchmarks.peers.cli import main

if __name__ == "__main__":
    sys.exit(main())
