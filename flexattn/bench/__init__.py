"""Benchmarks and sweeps, installed with flexattn so they run from any directory (docs/benchmarks.md
holds what they measured, with the device and versions of each run).

``python -m flexattn.bench --mode fwd|bwd|decode [ARGS]`` (also ``flexattn bench``) runs one of the
paper benchmarks, side by side in one process with torch's compiled flex_attention and SDPA:
``forward``, ``backward`` (training) and ``decode``; ``model`` times a whole GPT-style training step
(eager, compiled and in CUDA graphs); ``fp8`` the forward on FP8 inputs and decoding from an FP8
cache. Beside them: ``learnable`` (the backward of
variants with learnable tables), the launch-config sweeps ``sweep`` and ``sweep_backward``,
``tile_census`` (what the compiler made of every default kernel), ``startup`` (the first call
and the host overhead), ``context_parallel`` (the ring's schedule on one GPU with streams for
ranks, and the ring's model at scale) and ``context_parallel_gpus`` (the real ranks, one process
per GPU, beside torch's context parallelism, which ``torch_context_parallel`` sets up). ``common``
holds what they share.
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
}


def run_mode(mode: str, argv: list) -> int:
    """Run the benchmark of ``mode`` with its own arguments ``argv``; its exit status."""
    return int(importlib.import_module(MODES[mode]).main(list(argv)) or 0)
