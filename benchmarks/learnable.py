"""Backward of variants that train a captured table: flexattn against torch's compiled flex_attention.

    python -m benchmarks.learnable --variants t5_bias graphormer alibi --tokens 4096

For each catalogue entry and head dim (bf16, H16, B4 at d=64 and B2 at d=128): the median time of one
backward (``torch.autograd.grad`` of q, k, v and the entry's learnable tensors, ``do_bench``) for
flexattn and for ``torch.compile(torch.nn.attention.flex_attention)`` in the same process, and the
relative error between the two implementations' gradients. A torch failure is recorded, not fatal.

``--deterministic`` times flexattn's deterministic backward (kernel option ``DETERMINISTIC``)
instead of torch's: its time, its cost against the default, whether two of its runs give the same bits, and the same for
the default (whose learnable-tensor gradients are summed with atomics in the order the GPU picks).
``relative_bias`` (a table read at ``q_idx - kv_idx``, one element per diagonal: every pair of a
tile shares its element with others) may be named beside the catalogue's entries.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import flexattn
from flexattn.variants import CATALOGUE, Instance, causal_mask


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _backward_ms(out, inputs, grad_out) -> tuple[float, tuple]:
    import triton.testing

    def run():
        return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

    for _ in range(6):  # settles the plan (see [Note] Tiles the compiler made costly)
        grads = run()
    return triton.testing.do_bench(run, warmup=5, rep=50, return_mode="median"), grads


def _relative_bias(H: int, L: int) -> Instance:
    """Causal, plus a learnable bias per head and relative position (``[H, 2L]``, float32)."""
    bias = (0.1 * torch.randn(H, 2 * L, device="cuda")).requires_grad_()

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + L]

    return Instance(relative_bias, causal_mask, learnable=(bias,))


def _same_bits(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def run_case(name: str, head_dim: int, tokens: int, torch_flex, deterministic: bool = False) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    B, H, L = (4 if head_dim <= 64 else 2), 16, tokens
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    inst = _relative_bias(H, L) if name == "relative_bias" else CATALOGUE[name].make(B, H, L, L, "cuda")
    inputs = (q, k, v) + tuple(inst.learnable)
    row = {"variant": name, "D": head_dim, "B": B, "H": H, "L": L, "learnable": len(inst.learnable)}
    block_mask = inst.block_mask(None, None, L, L, "cuda")
    out = flexattn.flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=block_mask)
    row["flexattn_bwd_ms"], ours = _backward_ms(out, inputs, grad_out)
    if deterministic:
        row["default_bit_identical"] = _same_bits(ours, torch.autograd.grad(out, inputs, grad_out, retain_graph=True))
        det_out = flexattn.flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=block_mask,
                                          kernel_options={"DETERMINISTIC": True})
        row["deterministic_bwd_ms"], det = _backward_ms(det_out, inputs, grad_out)
        row["deterministic_cost"] = row["deterministic_bwd_ms"] / row["flexattn_bwd_ms"]
        again = torch.autograd.grad(det_out, inputs, grad_out, retain_graph=True)
        row["deterministic_bit_identical"] = _same_bits(det, again)
        row["deterministic_vs_default_rel_err"] = [round(_rel_err(a, b), 7) for a, b in zip(det, ours)]
        del det_out, det, again
    if deterministic or name == "relative_bias":
        return row  # the deterministic run compares flexattn with itself
    try:
        tbm = torch_create_block_mask(inst.mask_mod, None, None, L, L, device="cuda") if inst.mask_mod else None
        theirs_out = torch_flex(q, k, v, score_mod=inst.score_mod, block_mask=tbm)
        row["torch_compiled_bwd_ms"], theirs = _backward_ms(theirs_out, inputs, grad_out)
    except Exception as err:  # torch's kernels may not fit the GPU (T5's bias on the H100)
        row["torch_error"] = str(err).strip().splitlines()[0][:300]
    else:
        row["speedup"] = row["torch_compiled_bwd_ms"] / row["flexattn_bwd_ms"]
        row["grad_rel_err_vs_torch"] = [round(_rel_err(a, b), 6) for a, b in zip(ours, theirs)]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["t5_bias", "graphormer", "alibi"],
                        choices=sorted(CATALOGUE) + ["relative_bias"])
    parser.add_argument("--deterministic", action="store_true",
                        help="time the deterministic backward (instead of torch's) and check that two of its runs "
                             "match bit for bit")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.learnable times GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    torch_flex = torch.compile(torch_flex_attention, dynamic=False)
    rows = []
    for head_dim in args.head_dims:
        for name in args.variants:
            rows.append(run_case(name, head_dim, args.tokens, torch_flex, args.deterministic))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if not args.deterministic:
        print("\n| variant | d | flexattn bwd ms | torch compiled bwd ms | speed-up | grad rel err vs torch |")
        print("|---|---|---|---|---|---|")
    for r in [] if args.deterministic else rows:
        theirs = f"{r['torch_compiled_bwd_ms']:.2f}" if "torch_compiled_bwd_ms" in r else f"failed: {r['torch_error'][:60]}"
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        err = f"{max(r['grad_rel_err_vs_torch']):.1e}" if "grad_rel_err_vs_torch" in r else "-"
        print(f"| {r['variant']} | {r['D']} | {r['flexattn_bwd_ms']:.2f} | {theirs} | {speedup} | {err} |")
    if args.deterministic:
        print("\n| variant | d | default bwd ms | deterministic bwd ms | cost | same bits twice: deterministic / default "
              "| rel. difference from default |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['D']} | {r['flexattn_bwd_ms']:.2f} | {r['deterministic_bwd_ms']:.2f} | "
                  f"{r['deterministic_cost']:.2f}x | {r['deterministic_bit_identical']} / {r['default_bit_identical']} "
                  f"| {max(r['deterministic_vs_default_rel_err']):.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
