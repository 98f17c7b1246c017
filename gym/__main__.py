"""The gym's main job: every catalogue variant through the public API on the local device.

    python -m gym [--seq-len N] [--device cuda|cpu]

For each variant it builds the BlockMask, runs ``flexattn.flex_attention`` (the fused Triton kernel
on a GPU, the blockwise PyTorch path on a CPU), checks the output against the float64 reference
built from the same mods, and times a warm call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import flexattn
from flexattn.reference import reference_attention
from gym.catalogue import CATALOGUE


def time_call(fn, device: str, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run every catalogue variant through flexattn and check it.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 2048 on a GPU, 1024 on a CPU")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    device = args.device
    L = args.seq_len or (2048 if device == "cuda" else 1024)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, H, D = 1, args.heads, args.head_dim
    backend = "Triton kernel" if device == "cuda" else "blockwise PyTorch backend"
    print(f"flexattn {backend} on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
          f"B={B} H={H} L={L} D={D} {str(dtype).replace('torch.', '')}")
    print(f"{'variant':<16}{'sparsity':>9}{'max abs err':>13}{'rel err':>10}{'ms':>9}")
    worst = 0.0
    for name, variant in CATALOGUE.items():
        q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype) for _ in range(3))
        score_mod, mask_mod = variant.build(B, H, L, L, device)
        bm = flexattn.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
        run = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)  # noqa: E731
        out = run()
        ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod, mask_mod=mask_mod)
        err = (out.double() - ref).abs().max().item()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        worst = max(worst, rel)
        ms = time_call(run, device) * 1e3
        sparsity = bm.sparsity() if bm is not None else 0.0
        print(f"{name:<16}{sparsity:>8.1f}%{err:>13.2e}{rel:>10.1e}{ms:>9.2f}")
    budget = 2e-2 if dtype == torch.bfloat16 else 1e-5
    print(f"worst relative error {worst:.1e} (budget {budget:.0e} for {str(dtype).replace('torch.', '')})")
    return 0 if worst < budget else 1


if __name__ == "__main__":
    sys.exit(main())
