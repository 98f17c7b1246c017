"""``python -m flexattn.gym [ARGS]``: the same as ``flexattn gym [ARGS]``."""

import sys

from flexattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["gym", *sys.argv[1:]]))
