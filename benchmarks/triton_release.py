"""flexattn's default kernels under whichever Triton this process imports: one JSON line per case.

    PYTHONPATH=/path/to/other/triton:. python -m benchmarks.triton_release > t39.jsonl

For checking a Triton release before the Gluon guard (kernels/hopper/common.py GLUON_TRITON_VERSIONS) lets it
run the Hopper kernels: run it once under the release the guard already takes and once under the new
one, on the same machine, and compare (docs/benchmarks_log.md, "The Gluon kernels under Triton 3.7,
3.8 and 3.9"). Each line names the Triton, the case, which family ran the forward and the backward
("gluon" or "portable"), the times (do_bench medians) and TFLOP/s: 4 * B * H * L * S * D * density
for the forward, 2.5 times that for the backward. bf16, 16k tokens, H16, B4 at d=64 and B2 at d=128
(the backward sections' setup).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import flexattn
from flexattn.bench.common import block_density
from flexattn.variants import CATALOGUE

VARIANTS = ("noop", "causal", "alibi", "softcap", "document_mask")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(CATALOGUE), metavar="VARIANT")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--rep", type=float, default=200, help="do_bench budget per timing, ms")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from flexattn.kernels.hopper import backward as hopper_backward, forward as hopper_forward

    device, L, H = torch.device("cuda"), args.seq_len, 16
    for D in args.head_dims:
        B = 4 if D == 64 else 2
        for name in args.variants:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            score_mod, mask_mod = CATALOGUE[name].build(B, H, L, L, device)
            block_mask = flexattn.create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
            density = block_density(block_mask) if block_mask is not None else 1.0

            def forward():
                with torch.no_grad():
                    return flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

            before = hopper_forward.launches
            forward()
            forward_path = "gluon" if hopper_forward.launches > before else "portable"
            forward_ms = do_bench(forward, rep=args.rep)
            out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
            grad_out = torch.randn_like(out)

            def backward():
                return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

            before = hopper_backward.launches
            backward()
            backward_path = "gluon" if hopper_backward.launches > before else "portable"
            backward_ms = do_bench(backward, rep=args.rep)
            flops = 4.0 * B * H * L * L * D * density
            print(json.dumps(dict(
                triton=triton.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(), D=D,
                variant=name, B=B, H=H, L=L, density=round(density, 4), path=forward_path, bwd_path=backward_path,
                fwd_ms=round(forward_ms, 3), bwd_ms=round(backward_ms, 3),
                fwd_tflops=round(flops / forward_ms / 1e9, 1), bwd_tflops=round(2.5 * flops / backward_ms / 1e9, 1),
            )), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
