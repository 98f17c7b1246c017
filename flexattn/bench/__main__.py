"""``python -m flexattn.bench [--mode fwd|bwd|decode|model|fp8|host] [ARGS]``: one of the paper benchmarks; ARGS go
to it (``--help`` after the mode lists them)."""

import argparse
import sys

from flexattn.bench import MODES, run_mode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexattn.bench", add_help=False,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=tuple(MODES), default="fwd",
                        help="fwd: forward (default); bwd: forward and backward; decode: one query token; "
                             "model: a GPT-style training step; fp8: FP8 forward and FP8-cache decoding; "
                             "host: warm calls' host time and the first call's time")
    args, rest = parser.parse_known_args(argv)
    return run_mode(args.mode, rest)


if __name__ == "__main__":
    sys.exit(main())
