"""Where a warm eager call's and a first call's host time goes on a GPU, by cProfile (issue 52).

    python -m benchmarks.host_profile --out-dir prof           # warm calls, then a cold and a warm first call
    python -m benchmarks.host_profile --warm-only fwd_mask      # one case's warm profile
    python -m benchmarks.host_profile --warm-only fwd_mask fwd_mask_d128 --out-dir prof   # the Gluon path too

The GPU counterpart of ``host_proxy`` (which stubs the launches on a CPU). Warm calls: the cases of
``flexattn bench --mode host`` (B1 H4 L256 d64 bf16; the decode step GQA 16:2 over 1024 keys), and
the masked forward at d128 (``fwd_mask_d128``, the Gluon forward's eager path on a Hopper), each
timed unprofiled (mean of 300 calls) and then profiled over 300 calls; ``warm_calls.txt`` holds both
sorts (own time, cumulative). First call: ALiBi + causal, B1 H16 L4096 d128 bf16, forward +
backward, in a fresh process under cProfile from before ``import torch``, on kernel caches of a
new folder: once cold, once warm (``first_call_cold.txt``, ``first_call_warm.txt``), with Python's
bytecode cached as an installed package's is (one untimed process first; see flexattn/bench/host.py).
Each profile's first line gives the unprofiled-style phase times of that process.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time

from flexattn.bench.host import FIRST_CALL_PROBLEM

CHILD = r"""
import cProfile, io, os, pstats, sys, time
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
import torch
t1 = time.perf_counter()
import flexattn
t2 = time.perf_counter()
torch.empty(1, device="cuda"); torch.cuda.synchronize()
t3 = time.perf_counter()
""" + FIRST_CALL_PROBLEM + r"""torch.cuda.synchronize()
t4 = time.perf_counter()
bm = flexattn.create_block_mask(causal, None, None, L, L, device="cuda")
torch.cuda.synchronize()
t5 = time.perf_counter()
out = flexattn.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
torch.cuda.synchronize()
t6 = time.perf_counter()
out.backward(grad)
torch.cuda.synchronize()
t7 = time.perf_counter()
prof.disable()
head = (f"{sys.argv[1]} (profiled): import torch {t1-t0:.2f} s, import flexattn {t2-t1:.2f} s, CUDA context "
        f"{t3-t2:.2f} s, block mask {t5-t4:.2f} s, forward {t6-t5:.2f} s, backward {t7-t6:.2f} s")
print(head, flush=True)
if sys.argv[2] != "-":
    with open(sys.argv[2], "w") as f:
        f.write(head + "\n")
        for sort in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(70)
            f.write(s.getvalue())
"""


def _stats(prof: cProfile.Profile, top: int) -> str:
    text = []
    for sort in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(top)
        text.append(f"# sorted by {sort}\n{s.getvalue()}")
    return "\n".join(text)


def warm_profiles(names, out_dir: str, calls: int = 300) -> None:
    import torch

    import flexattn
    from flexattn.variants import causal_mask, generate_alibi_bias

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q, k, v, grad = (torch.randn(1, 4, 256, 64, device=dev, dtype=dt) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    q128, k128, v128 = (torch.randn(1, 4, 256, 128, device=dev, dtype=dt) for _ in range(3))
    q1 = torch.randn(1, 16, 1, 64, device=dev, dtype=dt)
    k1, v1 = (torch.randn(1, 2, 1024, 64, device=dev, dtype=dt) for _ in range(2))
    alibi, alibi16 = generate_alibi_bias(4, dev), generate_alibi_bias(16, dev)
    bm = flexattn.create_block_mask(causal_mask, None, None, 256, 256, device=dev)
    flex = flexattn.flex_attention
    cases = {
        "fwd_mask": lambda: flex(q, k, v, score_mod=alibi, block_mask=bm),
        "fwd_plain": lambda: flex(q, k, v),
        "fwd_bwd": lambda: flex(qg, kg, vg, score_mod=alibi, block_mask=bm).backward(grad),
        "decode": lambda: flex(q1, k1, v1, score_mod=alibi16, enable_gqa=True),
        # Head dim 128: the Gluon forward takes it on a Hopper (its kept choice and prepared launch).
        "fwd_mask_d128": lambda: flex(q128, k128, v128, score_mod=alibi, block_mask=bm),
    }
    with open(os.path.join(out_dir, "warm_calls.txt"), "w") as f:
        for name in names or cases:
            fn = cases[name]
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host_us = (time.perf_counter() - start) / calls * 1e6
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            per_call = pstats.Stats(prof).total_calls / calls  # function calls, Python's and builtins'
            print(f"{name}: {host_us:.1f} us/call unprofiled, {per_call:.0f} function calls a call", flush=True)
            f.write(f"######## {name}: {host_us:.1f} us/call unprofiled, {per_call:.0f} function calls a call, "
                    f"then {calls} calls profiled\n")
            f.write(_stats(prof, 45) + "\n")


def first_call_profiles(out_dir: str) -> None:
    import flexattn

    root = os.path.dirname(os.path.dirname(os.path.abspath(flexattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory(prefix="flexattn-host-profile-") as work:
        env["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
        for tag, caches in (("bytecode", "throwaway"), ("cold", "caches"), ("warm", "caches")):
            run_env = dict(env, FLEXATTN_CACHE_DIR=os.path.join(work, caches, "flexattn"),
                           TRITON_CACHE_DIR=os.path.join(work, caches, "triton"),
                           TORCHINDUCTOR_CACHE_DIR=os.path.join(work, caches, "inductor"))
            target = "-" if tag == "bytecode" else os.path.join(out_dir, f"first_call_{tag}.txt")
            done = subprocess.run([sys.executable, "-c", CHILD, tag, target], env=run_env, capture_output=True,
                                  text=True, timeout=600)
            print((done.stdout.strip() or done.stderr.strip()[-500:]), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=".", help="where the profiles are written")
    parser.add_argument("--warm-only", nargs="*", default=None, metavar="CASE",
                        help="warm calls only (all five cases, or those named)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.host_profile needs a CUDA GPU (on a CPU: python -m benchmarks.host_proxy --profile)",
              file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    warm_profiles(args.warm_only, args.out_dir)
    if args.warm_only is None:
        first_call_profiles(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
