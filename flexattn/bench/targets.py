"""The speed targets the benchmarks check their rows against: the Hopper issue's bar (issue 22).

A benchmark prints one ``below target:`` line for each miss after its table, so that a run on the
device says which targets hold without reading the table by hand; ``python -m flexattn.bench.targets
docs/data/RUN.json`` says the same of a stored run. A target whose measurement the
run did not make (torch's FLASH path without ``--torch-flash``, the deterministic backward without
``--two-pass``, cuDNN refusing a shape) is not checked and says nothing. The targets were stated for
an H100; on another GPU the lines say how far this run is from them, nothing more.

Each target reads a ratio of times as the benchmark rows store it, other_ms / flexattn_ms: above 1,
flexattn is faster (for the deterministic backward, the other is flexattn's own deterministic call).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NamedTuple

__all__ = ["Target", "FORWARD", "BACKWARD", "misses", "targets_for"]

DENSE_CASES = ("noop", "causal")  # the cases held against torch's FLASH path and cuDNN (whose only mask is causal)


class Target(NamedTuple):
    key: str  # the row's ratio of times, other_ms / flexattn_ms
    bound: float
    against: str  # what the ratio compares with, for the line printed
    variants: tuple = ()  # () for every variant
    at_most: bool = False  # the ratio must stay at or under ``bound`` rather than reach it

    def missed_by(self, row: dict) -> bool:
        value = row.get(self.key)
        if value is None or (self.variants and row["variant"] not in self.variants):
            return False  # not measured in this run, or not this target's case
        return value > self.bound if self.at_most else value < self.bound


# Forward (bench/forward.py rows): at least torch's FLASH path and cuDNN on the dense cases, and 1.35x
# torch's compiled Triton flex_attention on every case.
FORWARD = (
    Target("speedup_vs_torch_flex", 1.35, "torch's compiled flex_attention (Triton)"),
    Target("ratio_vs_torch_flash", 1.0, "torch's flex_attention, BACKEND FLASH", DENSE_CASES),
    Target("ratio_vs_cudnn", 1.0, "SDPA cuDNN", DENSE_CASES),
)

# Backward (bench/backward.py rows): 1.3x torch's Triton flex everywhere, 0.9x its FLASH path and
# 1.0x cuDNN on the dense cases, and the deterministic backward (``--two-pass``: its time over the
# default's) within 15% of the default.
BACKWARD = (
    Target("bwd_speedup_vs_torch_flex", 1.3, "torch's compiled flex_attention (Triton)"),
    Target("bwd_ratio_vs_torch_flash", 0.9, "torch's flex_attention, BACKEND FLASH", DENSE_CASES),
    Target("bwd_ratio_vs_cudnn", 1.0, "SDPA cuDNN", DENSE_CASES),
    Target("bwd_ratio_vs_two_pass", 1.15, "the deterministic backward's time over the default's", at_most=True),
)


def misses(rows: list[dict], targets: tuple) -> list[str]:
    """One line for each target a row misses, e.g. ``"causal d=128: 0.880x torch's flex_attention,
    BACKEND FLASH (target 0.90x)"``."""
    lines = []
    for row in rows:
        for target in targets:
            if target.missed_by(row):
                # Three digits: 0.897 must not read as the 0.90 it misses.
                bound = f"at most {target.bound:.2f}x" if target.at_most else f"{target.bound:.2f}x"
                lines.append(f"{row['variant']} d={row['D']}: {row[target.key]:.3f}x {target.against} "
                             f"(target {bound})")
    return lines


def targets_for(rows: list[dict]) -> tuple:
    """BACKWARD for the training benchmark's rows, FORWARD for the forward benchmark's."""
    return BACKWARD if any("bwd_ms" in key for row in rows for key in row) else FORWARD


def main(argv=None) -> int:
    """``python -m flexattn.bench.targets RESULT.json ...``: the targets each stored run misses."""
    parser = argparse.ArgumentParser(description="The targets each stored benchmark run misses.")
    parser.add_argument("results", nargs="+", help="JSON written by bench.forward or bench.backward (--out)")
    args = parser.parse_args(argv)
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        rows, env = result.get("rows", []), result.get("env", {})
        where = ", ".join(f"{key} {env[key]}" for key in ("gpu", "device", "torch", "triton") if env.get(key))
        targets = targets_for(rows)
        print(f"{path}: {'backward' if targets is BACKWARD else 'forward'}, {len(rows)} cases ({where})")
        lines = misses(rows, targets)
        for line in lines:
            print(f"  below target: {line}")
        if not lines:
            print("  every target this run measured holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
