"""Sweep flexattn forward launch configurations on the local GPU (how runtime defaults were chosen).

    python -m benchmarks.sweep --head-dims 64 128 --variants noop causal alibi
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import flexattn
from flexattn.bench.common import KV_BYTES, bench, block_density
from flexattn.variants import CATALOGUE

# (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA, WARP_SPECIALIZE)
CONFIGS = [
    (64, 128, 4, 3, 0, 0), (64, 128, 4, 2, 1, 0), (64, 128, 4, 3, 1, 0), (64, 64, 4, 2, 1, 0),
    (64, 64, 4, 3, 0, 0), (64, 64, 4, 3, 1, 0), (128, 64, 4, 2, 1, 0), (128, 64, 4, 3, 0, 0),
    (128, 128, 4, 2, 1, 0), (128, 128, 8, 3, 0, 0), (128, 128, 8, 2, 1, 0), (128, 128, 4, 2, 1, 1),
    (64, 32, 4, 2, 1, 0),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--variants", nargs="+", default=["noop", "causal", "alibi"])
    parser.add_argument("--seq-len", type=int, default=16384)
    args = parser.parse_args(argv)
    L = args.seq_len
    for D in args.head_dims:
        H = 16
        B = max(1, KV_BYTES // (H * L * D * 2))
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in args.variants:
            score_mod, mask_mod = CATALOGUE[name].build(B, H, L, L, "cuda")
            bm = flexattn.create_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None
            flops = 4.0 * B * H * L * L * D * (block_density(bm) if bm is not None else 1.0)
            results = []
            baseline = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm).float()
            default_ms = bench(lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm), rep_ms=100)
            for (bm_, bn, w, s, tma, ws) in CONFIGS:
                opts = {"BLOCK_M": bm_, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "USE_TMA": bool(tma),
                        "WARP_SPECIALIZE": bool(ws)}
                tag = [bm_, bn, w, s, "ws" if ws else "tma" if tma else "ptr"]
                try:
                    fn = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, kernel_options=opts)  # noqa: E731
                    diff = ((fn().float() - baseline).abs().max() / baseline.abs().max()).item()
                    ms = bench(fn, rep_ms=100)
                    results.append((round(flops / ms / 1e9, 1), *tag, round(diff, 4)))
                except Exception as err:  # out of resources: not a candidate
                    results.append((0.0, *tag, type(err).__name__, str(err)[-200:]))
            results.sort(key=lambda r: -r[0])
            print(json.dumps({"D": D, "variant": name, "B": B, "L": L,
                              "default_tflops": round(flops / default_ms / 1e9, 1), "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
