"""Tile census: every catalogue entry's default kernels, what the compiler made of them, and what
[Note] Tiles the compiler made costly (flexattn/kernels/family.py) does about it.

    python -m benchmarks.tile_census --head-dims 64 128 --tokens 4096 [--backward]

For each entry and head dim (bf16, H16, B4 at d=64 and B2 at d=128): the default plan's tiles and
stages, the compiled kernel's registers, spilled bytes per thread and shared memory, its median time
with the replanning rule off, and, where the rule replaces the plan, the final plan and its time.
With --backward, the same for the backward's dK/dV and dQ kernels, timing one backward (dq, dk, dv
and the gradients of learnable captured tensors).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import flexattn
import flexattn.kernels.backward as backward
import flexattn.kernels.family as family
import flexattn.kernels.forward as forward
from flexattn.kernels.launch import shared_bytes, spilled_bytes
from flexattn.variants import CATALOGUE


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _kernel_facts(kernel) -> dict:
    return {"regs": getattr(kernel, "n_regs", None), "spilled_bytes": spilled_bytes(kernel),
            "shared_bytes": shared_bytes(kernel)}


def _plan_of(kernel_object) -> dict:
    c = kernel_object.last_plan.constexprs("forward")
    return {"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"], "num_stages": c["num_stages"]}


def _rule_off_then_on(row: dict, call, kernels, plan_of, facts, before_call=lambda: None) -> None:
    """Fill row["default"] (the rule off) and row["rule"] (on; None when it keeps the default plan)
    with the settled plan, the compiled kernels' facts and the median time of ``call``."""
    limits = (family.SPILL_LIMIT_BYTES, family.STAGED_GATHER_BYTES)
    try:
        for rule_on in (False, True):
            family.SPILL_LIMIT_BYTES, family.STAGED_GATHER_BYTES = limits if rule_on else (1 << 40, 1 << 40)
            for kernel_object in kernels.values():
                kernel_object._plans.clear()
            for _ in range(6):  # the rule takes one step per call
                before_call()
                call()
            plan = plan_of(next(reversed(kernels.values())))
            if rule_on and plan == row["default"]["plan"]:
                row["rule"] = None  # kept
                return
            row["rule" if rule_on else "default"] = {"plan": plan, **facts(), "ms": _bench(call)}
    finally:
        family.SPILL_LIMIT_BYTES, family.STAGED_GATHER_BYTES = limits


def _cases(head_dims, tokens: int, variants, requires_grad: bool = False):
    """(head_dim, entry name, its instance, its BlockMask, q, k, v) for every entry asked for: bf16, H16,
    B4 at d=64 and B2 at d=128."""
    for head_dim in head_dims:
        B, H, L = (4 if head_dim <= 64 else 2), 16, tokens
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
                   for _ in range(3))
        for name, variant in CATALOGUE.items():
            if variants and name not in variants:
                continue
            inst = variant.make(B, H, L, L, "cuda")
            yield head_dim, name, inst, inst.block_mask(None, None, L, L, "cuda"), q, k, v


def census(head_dims, tokens: int, variants=None) -> list[dict]:
    launched = []
    real_launch = forward.launch

    def recording_launch(*args):
        launched.append(real_launch(*args))
        return launched[-1]

    forward.launch = recording_launch
    rows = []
    try:
        for head_dim, name, inst, block_mask, q, k, v in _cases(head_dims, tokens, variants):
            def call():
                return flexattn.flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=block_mask)

            row = {"variant": name, "head_dim": head_dim}
            _rule_off_then_on(row, call, forward._kernels, _plan_of, lambda: _kernel_facts(launched[-1]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        forward.launch = real_launch
    return rows


def _backward_plan_of(kernel_object) -> dict:
    plan = next(reversed(kernel_object._plans.values()))
    return {name: {"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"], "num_stages": c["num_stages"]}
            for name, c in ((role, plan.constexprs(role)) for role in ("dkdv", "dq"))}


def backward_census(head_dims, tokens: int, variants=None) -> list[dict]:
    launched = []
    real_launch = backward.launch

    def recording_launch(jit_fn, *args):
        launched.append((jit_fn, real_launch(jit_fn, *args)))
        return launched[-1][1]

    def facts() -> dict:
        # The last backward's dK/dV and dQ kernels (the preprocess is not replanned).
        last = {}
        for jit_fn, kernel in launched:
            for name in ("dkdv", "dq"):
                if getattr(jit_fn, "__name__", "").endswith(f"_{name}"):
                    last[name] = _kernel_facts(kernel)
        return last

    backward.launch = recording_launch
    rows = []
    try:
        for head_dim, name, inst, block_mask, q, k, v in _cases(head_dims, tokens, variants, requires_grad=True):
            out = flexattn.flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=block_mask)
            grad_out = torch.randn_like(out)
            inputs = (q, k, v) + tuple(inst.learnable)

            def call():
                return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)

            row = {"variant": name, "head_dim": head_dim}
            _rule_off_then_on(row, call, backward._kernels, _backward_plan_of, facts, launched.clear)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        backward.launch = real_launch
    return rows


def _print_backward_table(rows) -> None:
    def tiles(r, name):
        p = r["plan"][name]
        return f"{p['BLOCK_M']}x{p['BLOCK_N']}, {p['num_stages']}"

    def kernels(r):
        return " / ".join(f"{tiles(r, n)}: {r[n]['spilled_bytes']} B, {r[n]['shared_bytes'] / 1024:.0f} KB"
                          for n in ("dkdv", "dq"))

    print("\n| variant | d | default dK/dV / dQ: tiles, stages: spilled, shared | ms | replanned | ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d, n = r["default"], r.get("rule")
        line = f"| {r['variant']} | {r['head_dim']} | {kernels(d)} | {d['ms']:.3f} | "
        line += f"{kernels(n)} | {n['ms']:.3f} | {d['ms'] / n['ms']:.2f}x |" if n else "kept | | |"
        print(line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--variants", nargs="+", choices=sorted(CATALOGUE), help="these entries only (default: all)")
    parser.add_argument("--backward", action="store_true", help="the backward's kernels instead of the forward's")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.tile_census compiles GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    if args.backward:
        rows = backward_census(args.head_dims, args.tokens, args.variants)
        _print_backward_table(rows)
        _write(args.out, rows)
        return 0
    rows = census(args.head_dims, args.tokens, args.variants)
    print("\n| variant | d | default tiles, stages | spilled B | shared KB | ms | replanned | spilled B | shared KB | ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, n = r["default"], r.get("rule")
        tiles = lambda p: f"{p['BLOCK_M']}x{p['BLOCK_N']}, {p['num_stages']}"  # noqa: E731
        line = (f"| {r['variant']} | {r['head_dim']} | {tiles(d['plan'])} | {d['spilled_bytes']} | "
                f"{d['shared_bytes'] / 1024:.0f} | {d['ms']:.3f} | ")
        line += (f"{tiles(n['plan'])} | {n['spilled_bytes']} | {n['shared_bytes'] / 1024:.0f} | {n['ms']:.3f} | "
                 f"{d['ms'] / n['ms']:.2f}x |") if n else "kept | | | | |"
        print(line)
    _write(args.out, rows)
    return 0


def _write(path, rows) -> None:
    if path:
        import triton

        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
