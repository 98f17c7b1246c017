"""``python -m flexattn COMMAND ...``: the ``flexattn`` command, where its console script is not on the PATH."""

import sys

from flexattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
