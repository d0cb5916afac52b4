"""``python -m lightning_dp_strategies compare``."""

import sys

from lightning_dp_strategies.cli import main

if __name__ == "__main__":
    sys.exit(main())
