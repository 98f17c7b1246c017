"""First-call latency and warm-call host overhead of flexattn on the local GPU.

    python -m benchmarks.startup            # runs the measurements in fresh subprocesses

First call: a fresh Python process imports torch and flexattn (not counted), then times one call
with a new score_mod and mask_mod: trace, lower, render, Triton compile and run, synchronised.
Measured twice: with empty flexattn and Triton caches (cold), and again with the caches filled by
the first run (warm disk cache, as in any later process).

Warm-call host overhead: the time the host spends in one call once everything is built, measured
as the mean wall time of many back-to-back calls on a tiny problem, so the GPU is never the
bottleneck (the same method as timing Python launch overhead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time, json, sys
import torch
import flexattn
from flexattn.variants import generate_alibi_bias, causal_mask
torch.cuda.init(); torch.empty(1, device="cuda")
q, k, v = (torch.randn(4, 16, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
alibi = generate_alibi_bias(16, "cuda")
t0 = time.perf_counter()
bm = flexattn.create_block_mask(causal_mask, None, None, 4096, 4096, device="cuda")
t1 = time.perf_counter()
out = flexattn.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
torch.cuda.synchronize()
t2 = time.perf_counter()
# A second kernel in the same process: no mods at d=128, the warp-specialised one on Hopper.
q2, k2, v2 = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
t3 = time.perf_counter()
flexattn.flex_attention(q2, k2, v2)
torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps({"block_mask_s": t1 - t0, "first_call_s": t2 - t1, "first_call_noop_d128_s": t4 - t3}))
"""

OVERHEAD = r"""
import time, json
import torch
import flexattn
from flexattn.variants import generate_alibi_bias, causal_mask
q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
alibi = generate_alibi_bias(1, "cuda")
bm = flexattn.create_block_mask(causal_mask, None, None, 128, 128, device="cuda")
results = {}
for name, kwargs in (("noop", {}), ("alibi+causal", {"score_mod": alibi, "block_mask": bm})):
    for _ in range(50):
        flexattn.flex_attention(q, k, v, **kwargs)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        flexattn.flex_attention(q, k, v, **kwargs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    results[name + "_us"] = (t1 - t0) / n * 1e6
# The same loop on torch's SDPA, for scale: the host cost of one plain PyTorch attention call.
import torch.nn.functional as F
for _ in range(50):
    F.scaled_dot_product_attention(q, k, v)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(2000):
    F.scaled_dot_product_attention(q, k, v)
t1 = time.perf_counter()
results["sdpa_us"] = (t1 - t0) / 2000 * 1e6
print(json.dumps(results))
"""


def run_child(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Measures in fresh subprocesses on the local CUDA GPU; prints JSON.",
    ).parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.startup times flexattn's kernels on a CUDA GPU, and this machine has none; on a CPU, "
              "`python -m pytest -q` runs every kernel in Triton's interpreter instead", file=sys.stderr)
        return 2
    env = dict(os.environ)
    # The children import this very flexattn (an installed one or a checkout), whatever their cwd.
    import flexattn

    root = os.path.dirname(os.path.dirname(os.path.abspath(flexattn.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as cache:
        env["FLEXATTN_CACHE_DIR"] = os.path.join(cache, "flexattn")
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        cold = run_child(CHILD, env)
        warm = run_child(CHILD, env)
        overhead = run_child(OVERHEAD, env)
    result = {"first_call_cold_cache": cold, "first_call_warm_cache": warm, "warm_call_host_overhead": overhead}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
