"""``python -m infinity.cli``: the ``infinity`` program (the form torchrun and the tools start it in)."""

import sys

from infinity.cli import main

if __name__ == "__main__":
    sys.exit(main())
