"""Host time of warm calls and time of the first call, beside torch's compiled flex_attention (issue 52).

    python -m flexattn.bench --mode host --out host.json      # or: flexattn bench --mode host -- --out ...

Warm calls, in this process, flexattn and ``torch.compile(flex_attention)`` on the same inputs: a
forward with ALiBi and a causal BlockMask, one with neither, that first one's forward + backward
(inputs that require grad, ``out.backward(grad)`` each call) and a decode step (one query token,
ALiBi, 16 query heads on 2 KV heads, 1024 cached keys). B1 H4 L256 d64 bf16 for the forwards: small
enough that the GPU never holds the host back. Host time is the mean wall time of ``--calls``
back-to-back calls with no synchronisation in the loop (common.host_us_per_call), the median of
three rounds. Beside it, the GPU's time per call with no host gaps: a spin kernel holds the stream
while the host enqueues a burst of calls, which then run back to back between two CUDA events. A
host time above that GPU time is the host's own; a row where it is not is flagged.

First call, each in a fresh process (``sys.executable -c CHILD``): ALiBi + causal, B1 H16 L4096 d128
bf16, forward + backward, timed from before ``create_block_mask`` to after synchronising; cold (empty
flexattn, Triton and Inductor caches: FLEXATTN_CACHE_DIR, TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR
in a new temporary folder) and warm (a second process on the same folders). The process's wall time
too, from before it was spawned, so with the interpreter's start, ``import torch``, ``import
flexattn`` (torch: its flex_attention module and torch.compile) and the CUDA context.

Python's bytecode is cached for the fresh processes as an installed package's is (pip writes it at
install): PYTHONDONTWRITEBYTECODE is dropped, PYTHONPYCACHEPREFIX points at a folder of this run,
and one untimed process per library runs the same call first, on throwaway kernel caches. Without
that, a machine whose packages carry no bytecode (the lent GPUs' image: 4 s of ``compile()`` in one
warm flexattn process, 2026-12-07) times the compiling of torch's and sympy's sources, not the
libraries' first call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from flexattn.bench.common import host_us_per_call

# Issue 52's targets: warm host µs per call, the warm first call (s, CUDA context + first call) and
# the cold first call as a share of torch's.
TARGETS_US = {"fwd_mask": 40.0, "fwd_bwd": 80.0, "decode": 30.0}
TARGET_WARM_FIRST_CALL_S = 1.5
TARGET_COLD_SHARE_OF_TORCH = 0.6
CASES = {"fwd_mask": "fwd, ALiBi + causal BlockMask", "fwd_plain": "fwd, no mods",
         "fwd_bwd": "fwd + bwd, ALiBi + causal", "decode": "decode step, ALiBi, GQA 16:2, 1k keys"}

# The first call's problem, shared with benchmarks/host_profile.py's profiled child: its inputs
# and mods, made after the CUDA context (a string: it runs in a fresh process).
FIRST_CALL_PROBLEM = r"""
B, H, L, D = 1, 16, 4096, 128
q, k, v, grad = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H)
def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
"""

CHILD = r"""
import json, os, sys, time
start = time.perf_counter()
import torch
imported_torch = time.perf_counter()
if sys.argv[1] == "flexattn":
    import flexattn
    flex, create_block_mask = flexattn.flex_attention, flexattn.create_block_mask
else:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
imported = time.perf_counter()
torch.empty(1, device="cuda")
torch.cuda.synchronize()
cuda = time.perf_counter()
""" + FIRST_CALL_PROBLEM + r"""torch.cuda.synchronize()
before = time.perf_counter()
block_mask = create_block_mask(causal, None, None, L, L, device="cuda")
flex(q, k, v, score_mod=alibi, block_mask=block_mask).backward(grad)
torch.cuda.synchronize()
done = time.perf_counter()
print(json.dumps({"first_call_s": done - before, "cuda_context_s": cuda - imported,
                  "import_torch_s": imported_torch - start, "import_lib_s": imported - imported_torch,
                  "process_s": time.time() - float(os.environ["FLEXATTN_BENCH_SPAWNED_AT"])}))
"""


def gpu_us_per_call(fn, calls: int = 32):
    """The GPU's time per call of ``fn`` (µs) with no host gaps, or None where the host could not
    enqueue the burst while a spin kernel held the stream (a synchronisation in the call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # loads the spin kernel: its first launch would stretch the calibration
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 1_000_000 / start.elapsed_time(end)
    # Four times the burst's host time: the clock may rise above the calibration's, shortening the spin.
    spin_ms = 4e-3 * host_us_per_call(fn, calls, warmup=1) * calls + 5.0
    torch.cuda._sleep(int(spin_ms * cycles_per_ms))
    start.record()
    enqueue = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueue_ms = (time.perf_counter() - enqueue) * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls if enqueue_ms < 0.8 * spin_ms else None


def time_case(fn, calls: int) -> dict:
    host = statistics.median(host_us_per_call(fn, calls) for _ in range(3))
    return {"host_us": host, "gpu_us": gpu_us_per_call(fn)}


def warm_calls(lib: str, calls: int, results: dict) -> None:
    """Host and GPU µs per warm call of each of CASES for ``lib`` (flexattn or torch), into ``results``."""
    import flexattn
    from flexattn.bench.common import compile_torch_flex
    from flexattn.variants import causal_mask, generate_alibi_bias

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    B, H, L, D = 1, 4, 256, 64
    q, k, v, grad = (torch.randn(B, H, L, D, device=device, dtype=dtype) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    q1 = torch.randn(1, 16, 1, 64, device=device, dtype=dtype)  # decode.py's host-time step
    k1, v1 = (torch.randn(1, 2, 1024, 64, device=device, dtype=dtype) for _ in range(2))
    alibi, alibi16 = generate_alibi_bias(H, device), generate_alibi_bias(16, device)
    if lib == "flexattn":
        flex, create_block_mask = flexattn.flex_attention, flexattn.create_block_mask
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = compile_torch_flex()
    bm = create_block_mask(causal_mask, None, None, L, L, device=device)
    calls_of = {
        "fwd_mask": lambda: flex(q, k, v, score_mod=alibi, block_mask=bm),
        "fwd_plain": lambda: flex(q, k, v),
        "fwd_bwd": lambda: flex(qg, kg, vg, score_mod=alibi, block_mask=bm).backward(grad),
        "decode": lambda: flex(q1, k1, v1, score_mod=alibi16, enable_gqa=True),
    }
    for case, fn in calls_of.items():
        row = results.setdefault(case, {})
        try:
            fn()  # compile outside the timing
            torch.cuda.synchronize()
            row.update({f"{lib}_{key}": value for key, value in time_case(fn, calls).items()})
        except Exception as err:  # recorded, not fatal: the other rows still come
            row[f"{lib}_error"] = f"{type(err).__name__}: {str(err).strip()[:300]}"
        print(json.dumps({"case": case, **row}), flush=True)


def first_call(lib: str, cache_dir: str, env: dict) -> dict:
    """``CHILD`` for ``lib`` in a fresh process on the caches under ``cache_dir``."""
    env = dict(env, FLEXATTN_CACHE_DIR=os.path.join(cache_dir, "flexattn"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               FLEXATTN_BENCH_SPAWNED_AT=repr(time.time()))
    done = subprocess.run([sys.executable, "-c", CHILD, lib], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


_BYTECODE: list = []  # the run's PYTHONPYCACHEPREFIX folder, made on first use


def _bytecode_dir() -> str:
    if not _BYTECODE:
        import atexit
        import shutil

        _BYTECODE.append(tempfile.mkdtemp(prefix="flexattn-bench-host-pycache-"))
        atexit.register(shutil.rmtree, _BYTECODE[0], True)
    return _BYTECODE[0]


def first_calls(lib: str) -> dict:
    """Cold, then warm, first call of ``lib`` (flexattn or torch) on a cache folder of its own."""
    import flexattn

    # The children import this very flexattn (an installed one or a checkout), whatever their cwd.
    root = os.path.dirname(os.path.dirname(os.path.abspath(flexattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = _bytecode_dir()
    with tempfile.TemporaryDirectory(prefix=f"flexattn-bench-host-{lib}-bytecode-") as throwaway:
        first_call(lib, throwaway, env)  # untimed: writes the bytecode the timed processes read
    with tempfile.TemporaryDirectory(prefix=f"flexattn-bench-host-{lib}-") as cache_dir:
        result = {"cold": first_call(lib, cache_dir, env), "warm": first_call(lib, cache_dir, env)}
    print(json.dumps({"first_call": lib, **result}), flush=True)
    return result


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(value, limit: float, unit: str) -> str:
    met = "" if value is None else (" met" if value <= limit else " **missed**")
    return f"≤ {limit:g}{unit}{met}"


def table(result: dict) -> str:
    """The result as Markdown: a header line, the warm calls' table and the first call's."""
    env = result["env"]
    lines = [f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, CUDA {env.get('cuda')}, "
             f"Python {env['python']}, flexattn {env.get('flexattn_commit') or '?'}", ""]
    if env.get("poisoned_outputs"):  # a testing aid: a fill per output, on every call
        lines[-1:] = ["**FLEXATTN_POISON_OUTPUTS was set: every output was NaN-filled before its kernel ran; "
                      "host times include those fills. Unset it for numbers users see.**", ""]
    warm = result.get("warm")
    if warm:
        lines += ["| warm call, µs per call | flexattn host | torch host | target | flexattn GPU | torch GPU |",
                  "|---|---|---|---|---|---|"]
        host_bound = True
        for case, label in CASES.items():
            row = warm.get(case, {})
            cells = []
            for lib in ("flexattn", "torch"):
                host, gpu = row.get(f"{lib}_host_us"), row.get(f"{lib}_gpu_us")
                kept_up = host is None or (gpu is not None and gpu < host)
                host_bound &= kept_up
                cells.append(_num(gpu, 1) if kept_up else f"**{_num(gpu, 1)}, not below the host's**")
            target = _verdict(row.get("flexattn_host_us"), TARGETS_US[case], " µs") if case in TARGETS_US else "-"
            lines.append(f"| {label} | {_num(row.get('flexattn_host_us'), 1)} | {_num(row.get('torch_host_us'), 1)} | "
                         f"{target} | {cells[0]} | {cells[1]} |")
        lines += [""] + [f"failed: {lib} {case}: {row[f'{lib}_error']}" for case, row in warm.items()
                         for lib in ("flexattn", "torch") if f"{lib}_error" in row]
        lines += ["GPU: µs per call of a burst enqueued while a spin kernel held the stream (CUDA events); "
                  + ("every host time is above its GPU time, so the host times are the host's."
                     if host_bound else "**a row whose GPU time is not below its host time (or is missing: the "
                     "call synchronises) may measure the GPU, not the host.**"), ""]
    first = result.get("first_call")
    if first:
        def seconds(lib, run, *keys):  # the sum of the keys' times, None where the run failed
            values = [first.get(lib, {}).get(run, {}).get(key) for key in keys]
            return None if None in values else sum(values)

        ours, theirs = seconds("flexattn", "cold", "first_call_s"), seconds("torch", "cold", "first_call_s")
        share = ours / theirs if ours and theirs else None
        rows = [("cold caches: first call", "cold", ("first_call_s",),
                 _verdict(share, TARGET_COLD_SHARE_OF_TORCH, "x torch") + (f" ({share:.2f}x)" if share else "")),
                ("warm caches: first call", "warm", ("first_call_s",), "-"),
                ("warm caches: CUDA context + first call", "warm", ("cuda_context_s", "first_call_s"),
                 _verdict(seconds("flexattn", "warm", "cuda_context_s", "first_call_s"), TARGET_WARM_FIRST_CALL_S,
                          " s")),
                ("cold caches: process, spawn to done", "cold", ("process_s",), "-"),
                ("warm caches: process, spawn to done", "warm", ("process_s",), "-"),
                ("warm caches: import torch + the library", "warm", ("import_torch_s", "import_lib_s"), "-")]
        lines += ["| first call, fwd + bwd, ALiBi + causal, B1 H16 L4096 d128, s | flexattn | torch | target |",
                  "|---|---|---|---|"]
        for label, run, keys, target in rows:
            lines.append(f"| {label} | {_num(seconds('flexattn', run, *keys), 2)} | "
                         f"{_num(seconds('torch', run, *keys), 2)} | {target} |")
        lines += [""] + [f"failed: {lib} {run}: {outcome['error']}" for lib, runs in first.items()
                         for run, outcome in runs.items() if "error" in outcome]
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flexattn bench --mode host", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="back-to-back calls per timing round (default 500)")
    parser.add_argument("--skip-torch", action="store_true", help="flexattn only: no torch.compile(flex_attention)")
    parser.add_argument("--skip-first-call", action="store_true", help="no fresh processes: warm calls only")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here (rewritten as they come)")
    parser.add_argument("--table", default=None, metavar="JSON",
                        help="print the tables of a saved run (--out's JSON) and measure nothing")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if not torch.cuda.is_available():
        print("flexattn bench --mode host needs a CUDA GPU: it measures the host's time per call beside the "
              "GPU's, and this machine has none (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import triton

    from flexattn.bench.common import git_commit

    result = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "cuda": torch.version.cuda,
                      "python": platform.python_version(), "flexattn_commit": git_commit(), "calls": args.calls,
                      "poisoned_outputs": os.environ.get("FLEXATTN_POISON_OUTPUTS", "0") not in ("", "0"),
                      "first_call_bytecode": "cached (an untimed process per library first)"},
              "warm": {}}
    # flexattn's numbers first, torch's after: a run cut short keeps flexattn's against the targets.
    for lib in ("flexattn",) if args.skip_torch else ("flexattn", "torch"):
        warm_calls(lib, args.calls, result["warm"])
        if not args.skip_first_call:
            result.setdefault("first_call", {})[lib] = first_calls(lib)
        if args.out:  # rewritten as it goes: a later failure or time-out keeps what was measured
            write_json(args.out, result)
    print("\n" + table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
