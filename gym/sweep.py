"""Sweep flexattn forward launch configurations on the local GPU (how runtime defaults were chosen).

    PYTHONPATH=. python -m gym.sweep --head-dims 64 128 --variants noop causal alibi
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import flexattn
from gym.benchmark import KV_BYTES, bench, block_density
from gym.catalogue import CATALOGUE

CONFIGS = [
    (128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--variants", nargs="+", default=["noop", "causal", "alibi"])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--tma", type=int, nargs="+", default=[0, 1], help="USE_TMA values to try")
    args = parser.parse_args(argv)
    L = args.seq_len
    for D in args.head_dims:
        H = 16
        B = max(1, KV_BYTES // (H * 16384 * D * 2))
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in args.variants:
            score_mod, mask_mod = CATALOGUE[name].build(B, H, L, L, "cuda")
            bm = flexattn.create_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None
            flops = 4.0 * B * H * L * L * D * (block_density(bm) if bm is not None else 1.0)
            results = []
            for (bm_, bn, w, s), tma in [(c, t) for c in CONFIGS for t in args.tma]:
                opts = {"BLOCK_M": bm_, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "USE_TMA": tma}
                try:
                    fn = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, kernel_options=opts)  # noqa: E731
                    fn()
                    ms = bench(fn, rep_ms=100)
                    results.append((round(flops / ms / 1e9, 1), bm_, bn, w, s, "tma" if tma else "ptr"))
                except Exception as err:  # out of resources: not a candidate
                    results.append((0.0, bm_, bn, w, s, "tma" if tma else "ptr", type(err).__name__, str(err)[-300:]))
            results.sort(reverse=True)
            print(json.dumps({"D": D, "variant": name, "B": B, "L": L, "best_tflops_cfg": results[:4],
                              "worst": results[-1]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
