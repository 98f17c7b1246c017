"""Per-kernel launch-configuration sweep of the Triton backward (how its defaults were chosen).

    python -m benchmarks.sweep_backward --head-dims 64 128 --variants noop causal alibi

For each case (bf16, 16k tokens, B*H so that K is 128 MiB), runs the backward under each candidate
BackwardConfig and reads every kernel's own GPU time from the CUDA profiler, so the dK/dV and the
dQ kernel are judged apart (a whole-backward timing would hide which kernel a change helped). The
candidates are paired: candidate i of the dK/dV list runs with candidate i of the dQ list.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flexattn.kernels.backward as backward
from flexattn import create_block_mask, flex_attention
from flexattn.kernels.configs import BackwardConfig
from flexattn.variants import CATALOGUE

SEQ_LEN = 16384
# (BLOCK, BLOCK, num_warps, num_stages) for the dK/dV kernel (M1, N1) and the dQ kernel (M2, N2).
DKDV = [(64, 64, 4, 2), (32, 64, 4, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3),
        (64, 64, 4, 1), (128, 64, 8, 2)]
DQ = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
      (64, 64, 4, 1), (64, 128, 4, 2)]


def kernel_times(run, reps: int = 4) -> dict:
    """Mean GPU ms per call of each backward kernel (by its name's suffix)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = event.cuda_time_total
        for kernel in ("dkdv", "dq", "preprocess"):
            if event.key.endswith(f"_{kernel}") or f"backward_{kernel}" in event.key:
                times[kernel] = total / 1000 / reps
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--variants", nargs="+", default=["noop", "causal"], choices=sorted(CATALOGUE))
    parser.add_argument("--no-tma", action="store_true", help="pointer loads only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.sweep_backward times GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    chosen: dict = {}
    # The sweep decides the configuration itself: the launcher's choice is replaced for this process.
    backward.select_backward_config = lambda *args_, **kwargs: chosen["cfg"]
    for dim in args.head_dims:
        B, H = max(1, (128 * 2**20) // (SEQ_LEN * dim * 2 * 16)), 16
        for name in args.variants:
            score_mod, mask_mod = CATALOGUE[name].build(B, H, SEQ_LEN, SEQ_LEN, "cuda")
            q, k, v = (torch.randn(B, H, SEQ_LEN, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            grad_out = torch.randn_like(q)
            block_mask = create_block_mask(mask_mod, B, 1, SEQ_LEN, SEQ_LEN, device="cuda") if mask_mod else None
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
            for (m1, n1, w1, s1), (m2, n2, w2, s2) in zip(DKDV, DQ):
                chosen["cfg"] = BackwardConfig(m1, n1, m2, n2, w1, s1, w2, s2, USE_TMA=not args.no_tma)
                backward._kernels.clear()  # plans are made per kernel object: start from none
                try:
                    t = kernel_times(lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True))
                except Exception as err:  # a shape the compiler rejects is reported, not fatal
                    print(f"d={dim} {name}: dK/dV {(m1, n1, w1, s1)} dQ {(m2, n2, w2, s2)} failed: {str(err)[:100]}")
                    continue
                print(f"d={dim} {name:15s} dK/dV {str((m1, n1, w1, s1)):18s} {t.get('dkdv', float('nan')):7.3f} ms   "
                      f"dQ {str((m2, n2, w2, s2)):18s} {t.get('dq', float('nan')):7.3f} ms", flush=True)
            del q, k, v, grad_out, out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
