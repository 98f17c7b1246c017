"""The paper benchmarks, installed with flexattn: ``flexattn bench --mode MODE`` (or ``python -m
flexattn.bench --mode MODE``) runs one on a CUDA GPU, side by side in one process with torch's
compiled flex_attention and SDPA.

``fwd`` (forward.py) and ``bwd`` (backward.py, training, with a gradient check) at 16k tokens on the
paper's seven variants; ``decode`` (decode.py) one query token against a KV cache; ``model``
(model.py) a whole GPT-style training step, eager, compiled and in CUDA graphs; ``fp8`` (fp8.py)
the forward on FP8 inputs and decoding from an FP8 cache; ``host`` (host.py) a warm call's host time
and the first call's time in a fresh process. ``common`` holds what they share. Each
takes its own arguments (``flexattn bench --mode bwd -- --help``) and writes its rows as JSON with
``--out``. docs/benchmarks.md holds the current numbers, with the device, versions and command of
each; the project's other measuring equipment is the checkout's benchmarks/ folder, not installed.
"""

import importlib

__all__ = ["MODES", "run_mode"]

# The benchmark of each mode of ``python -m flexattn.bench`` and ``flexattn bench``.
MODES = {
    "fwd": "flexattn.bench.forward",
    "bwd": "flexattn.bench.backward",
    "decode": "flexattn.bench.decode",
    "model": "flexattn.bench.model",
    "fp8": "flexattn.bench.fp8",
    "host": "flexattn.bench.host",
}


def run_mode(mode: str, argv: list) -> int:
    """Run the benchmark of ``mode`` with its own arguments ``argv``; its exit status."""
    return int(importlib.import_module(MODES[mode]).main(list(argv)) or 0)
