"""The speed targets of the Hopper issues (22, and 53 for training), held against the paper benchmarks' rows.

    python -m benchmarks.targets --run fwd [BENCHMARK ARGS]   # flexattn bench --mode fwd, then its misses
    python -m benchmarks.targets --run bwd --two-pass          # the same for the training benchmark
    python -m benchmarks.targets docs/data/RUN.json ...        # the misses of stored runs
    python -m benchmarks.targets --issue 53 --run bwd --torch-flash --two-pass --head-dims 128 \
        --variants causal document_mask --heads 32:8 8:1 --seq-len 8192 32768   # issue 53's GQA rows

The benchmarks themselves (flexattn/bench/forward.py and backward.py, what ``flexattn bench`` runs
for users) know no targets. ``--run`` runs one of them with its own arguments and then prints one
``below target:`` line for each miss, so that a run on the device says which targets hold without
reading the table by hand; given stored runs (their ``--out`` JSON), it says the same of each. A
target whose measurement the run did not make (torch's FLASH path without ``--torch-flash``, the
deterministic backward without ``--two-pass``, cuDNN refusing a shape) is not checked and says
nothing, except under issue 53, whose targets hold on every row: there a row that lacks torch's FLASH
path or the deterministic backward gets a ``not measured:`` line saying why. The targets were stated
for an H100; on another GPU the lines say how far this run is from them, nothing more.

``--issue N`` (first) picks the issue: 22 (the default) for both benchmarks, 53 for the training
benchmark's rows (GQA rows included).

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

from flexattn.bench.backward import shape_label

__all__ = ["Target", "FORWARD", "BACKWARD", "TRAINING", "ISSUES", "misses", "not_measured", "targets_for",
           "run_and_check"]

DENSE_CASES = ("noop", "causal")  # the cases held against torch's FLASH path and cuDNN (whose only mask is causal)


class Target(NamedTuple):
    key: str  # the row's ratio of times, other_ms / flexattn_ms
    bound: float
    against: str  # what the ratio compares with, for the line printed
    variants: tuple = ()  # () for every variant
    at_most: bool = False  # the ratio must stay at or under ``bound`` rather than reach it
    needs: str = ""  # the implementation (row key prefix) every row must measure; "" where a row may lack it

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


# Issue 53 (training on Hopper, grouped-query attention first; flexattn/bench/backward.py rows, its GQA rows
# included): on every row the backward at least torch's FLASH path, and cuDNN where cuDNN runs; the forward at
# least torch's FLASH path; the deterministic backward within 15% of the default.
TRAINING = (
    Target("bwd_ratio_vs_torch_flash", 1.0, "torch's FLASH path, backward", needs="torch_flash"),
    Target("bwd_ratio_vs_cudnn", 1.0, "SDPA cuDNN, backward"),
    Target("fwd_ratio_vs_torch_flash", 1.0, "torch's FLASH path, forward", needs="torch_flash"),
    Target("bwd_ratio_vs_two_pass", 1.15, "the deterministic backward's time over the default's", at_most=True,
           needs="flexattn_two_pass"),
)

# The training benchmark's option that runs each implementation a target may need.
ASKED_BY = {"torch_flash": "--torch-flash", "flexattn_two_pass": "--two-pass"}

# Each issue's targets, by the benchmark mode whose rows they read.
ISSUES = {22: {"fwd": FORWARD, "bwd": BACKWARD}, 53: {"bwd": TRAINING}}


def case(row: dict) -> str:
    """A row's name in the lines: ``"causal d=128"``, then its shape where the row records one
    (``"causal d=128 B2 H32:8 8k"``): the training benchmark's rows differ in heads and length too."""
    name = f"{row['variant']} d={row['D']}"
    return f"{name} {shape_label(row)}" if all(key in row for key in ("B", "H", "L")) else name


def misses(rows: list[dict], targets: tuple) -> list[str]:
    """One line for each target a row misses, e.g. ``"causal d=128 B2 H16 16k: 0.880x torch's
    flex_attention, BACKEND FLASH (target 0.90x)"``."""
    lines = []
    for row in rows:
        for target in targets:
            if target.missed_by(row):
                # Three digits: 0.897 must not read as the 0.90 it misses.
                bound = f"at most {target.bound:.2f}x" if target.at_most else f"{target.bound:.2f}x"
                lines.append(f"{case(row)}: {row[target.key]:.3f}x {target.against} (target {bound})")
    return lines


def not_measured(rows: list[dict], targets: tuple) -> list[str]:
    """One line for each row that lacks a target every row must measure (``Target.needs``), with why:
    the implementation's error, flexattn's, or that the run did not ask for it."""
    lines = []
    for row in rows:
        for target in targets:
            if not target.needs or row.get(target.key) is not None:
                continue
            if target.variants and row["variant"] not in target.variants:
                continue
            why = next((row[key] for key in (f"{target.needs}_error", f"{target.needs}_bwd_error", "flexattn_error",
                                              "flexattn_bwd_error") if row.get(key)), None)
            lines.append(f"{case(row)}: {target.against}: {why or f'not run (no {ASKED_BY[target.needs]})'}")
    return lines


def targets_for(rows: list[dict], issue: int = 22) -> tuple:
    """The issue's targets for these rows: the training benchmark's (rows with backward times) or the
    forward benchmark's; () where the issue has none for them."""
    mode = "bwd" if any("bwd_ms" in key for row in rows for key in row) else "fwd"
    return ISSUES[issue].get(mode, ())


def report(rows: list[dict], targets: tuple, indent: str = "") -> list[str]:
    """The ``below target:`` and ``not measured:`` lines of these rows."""
    return ([f"{indent}below target: {line}" for line in misses(rows, targets)]
            + [f"{indent}not measured: {line}" for line in not_measured(rows, targets)])


def run_and_check(mode: str, argv: list, issue: int = 22) -> int:
    """Run the paper benchmark of ``mode`` ("fwd" or "bwd") with its arguments ``argv``, then print a
    ``below target:`` line for each target of ``issue`` its rows miss (and a ``not measured:`` line for
    each they lack, where the issue wants every row); the benchmark's exit status."""
    from flexattn.bench import run_mode

    if mode not in ISSUES[issue]:
        raise SystemExit(f"issue {issue} has no targets for the {mode} benchmark (it has: {', '.join(ISSUES[issue])})")
    argv = list(argv)
    given = [arg.partition("=")[2] for arg in argv if arg.startswith("--out=")]
    given += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--out"]
    with tempfile.TemporaryDirectory() as scratch:
        out = given[-1] if given else os.path.join(scratch, f"{mode}.json")
        if not given:  # the rows come back through the benchmark's own JSON
            argv += ["--out", out]
        status = run_mode(mode, argv)
        if not os.path.exists(out):  # stopped before its first row (no GPU, bad arguments)
            print(f"issue {issue}'s targets: not checked, the benchmark wrote no rows")
            return status or 1
        with open(out) as f:
            rows = json.load(f).get("rows", [])
    print(f"issue {issue}'s targets:")
    for line in report(rows, ISSUES[issue][mode]) or ["every target this run measured holds"]:
        print(line)
    return status


def main(argv=None) -> int:
    """``python -m benchmarks.targets [--issue N] RESULT.json ...``: the targets each stored run misses;
    ``[--issue N] --run fwd|bwd [ARGS]``: a fresh run's (see run_and_check)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    issue = 22
    if argv[:1] == ["--issue"]:  # read by hand: what follows --run belongs to the benchmark
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) not in ISSUES:
            raise SystemExit(f"--issue takes one of {', '.join(map(str, ISSUES))}")
        issue, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--run"] and len(argv) > 1 and argv[1] in ("fwd", "bwd"):
        rest = argv[2:]
        return run_and_check(argv[1], rest[1:] if rest[:1] == ["--"] else rest, issue)
    parser = argparse.ArgumentParser(description="The targets each stored benchmark run misses (or, with "
                                     "'--run fwd|bwd [BENCHMARK ARGS]' first, a fresh run's); '--issue N' "
                                     f"first picks the issue's targets ({', '.join(map(str, ISSUES))}; default 22).")
    parser.add_argument("results", nargs="+", help="JSON written by flexattn/bench/forward.py or backward.py (--out)")
    args = parser.parse_args(argv)
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        rows, env = result.get("rows", []), result.get("env", {})
        where = ", ".join(f"{key} {env[key]}" for key in ("gpu", "device", "torch", "triton") if env.get(key))
        kind = "backward" if any("bwd_ms" in key for row in rows for key in row) else "forward"
        print(f"{path}: {kind}, {len(rows)} cases ({where})")
        targets = targets_for(rows, issue)
        if not targets:
            print(f"  issue {issue} has no targets for the {kind} benchmark's rows")
            continue
        for line in report(rows, targets, indent="  ") or ["  every target this run measured holds"]:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
