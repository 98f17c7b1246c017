"""The speed targets of the Hopper issue (issue 22), held against the paper benchmarks' rows.

    python -m benchmarks.targets --run fwd [BENCHMARK ARGS]   # flexattn bench --mode fwd, then its misses
    python -m benchmarks.targets --run bwd --two-pass          # the same for the training benchmark
    python -m benchmarks.targets docs/data/RUN.json ...        # the misses of stored runs

The benchmarks themselves (flexattn/bench/forward.py and backward.py, what ``flexattn bench`` runs
for users) know no targets. ``--run`` runs one of them with its own arguments and then prints one
``below target:`` line for each miss, so that a run on the device says which targets hold without
reading the table by hand; given stored runs (their ``--out`` JSON), it says the same of each. A
target whose measurement the run did not make (torch's FLASH path without ``--torch-flash``, the
deterministic backward without ``--two-pass``, cuDNN refusing a shape) is not checked and says
nothing. The targets were stated for an H100; on another GPU the lines say how far this run is from
them, nothing more.

Each target reads a ratio of times as the benchmark rows store it, other_ms / flexattn_ms: above 1,
flexattn is faster (for the deterministic backward, the other is flexattn's own deterministic call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import NamedTuple

__all__ = ["Target", "FORWARD", "BACKWARD", "misses", "targets_for", "run_and_check"]

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


# Forward (flexattn/bench/forward.py rows): at least torch's FLASH path and cuDNN on the dense cases, and 1.35x
# torch's compiled Triton flex_attention on every case.
FORWARD = (
    Target("speedup_vs_torch_flex", 1.35, "torch's compiled flex_attention (Triton)"),
    Target("ratio_vs_torch_flash", 1.0, "torch's flex_attention, BACKEND FLASH", DENSE_CASES),
    Target("ratio_vs_cudnn", 1.0, "SDPA cuDNN", DENSE_CASES),
)

# Backward (flexattn/bench/backward.py rows): 1.3x torch's Triton flex everywhere, 0.9x its FLASH path and
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


def run_and_check(mode: str, argv: list) -> int:
    """Run the paper benchmark of ``mode`` ("fwd" or "bwd") with its arguments ``argv``, then print a
    ``below target:`` line for each target its rows miss; the benchmark's exit status."""
    from flexattn.bench import run_mode

    argv = list(argv)
    given = [arg.partition("=")[2] for arg in argv if arg.startswith("--out=")]
    given += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--out"]
    with tempfile.TemporaryDirectory() as scratch:
        out = given[-1] if given else os.path.join(scratch, f"{mode}.json")
        if not given:  # the rows come back through the benchmark's own JSON
            argv += ["--out", out]
        status = run_mode(mode, argv)
        with open(out) as f:
            rows = json.load(f).get("rows", [])
    for line in misses(rows, FORWARD if mode == "fwd" else BACKWARD):
        print(f"below target: {line}")
    return status


def main(argv=None) -> int:
    """``python -m benchmarks.targets RESULT.json ...``: the targets each stored run misses;
    ``--run fwd|bwd [ARGS]``: a fresh run's (see run_and_check)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--run"] and len(argv) > 1 and argv[1] in ("fwd", "bwd"):
        rest = argv[2:]
        return run_and_check(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(description="The targets each stored benchmark run misses (or, with "
                                     "'--run fwd|bwd [BENCHMARK ARGS]' first, a fresh run's).")
    parser.add_argument("results", nargs="+", help="JSON written by flexattn/bench/forward.py or backward.py (--out)")
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
