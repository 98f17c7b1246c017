"""A mod's Python numbers as kernel arguments against the same numbers written as literals.

    python -m benchmarks.number_inputs                  # GPU: the paper's cases that read numbers, d=64 and 128
    python -m benchmarks.number_inputs --compiles-only  # only the "one kernel for every value" check

Since numbers a mod reads are runtime inputs (flexattn/trace/numbers.py), a sliding window's size, a
prefix length or a soft-cap reaches the kernel as a scalar argument instead of a constant of its
source. This times both forms of the paper benchmark's three cases that read a number (sliding
window, prefix LM, soft-cap) side by side, forward and forward+backward, in alternating rounds
(bf16, 16k tokens, batch x heads as the paper benchmark: K and V 256 MiB each), checks that both
forms give the same output, and checks that a window or prefix that changes at every step compiles
its kernels once (counted as Triton compilations, and as generated kernel modules).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch

import flexattn
from flexattn import create_block_mask, flex_attention

SEQ = 16384


def runtime_mods(window: int, prefix: int, cap: float) -> dict:
    """Each case as a user writes it: closures over Python numbers."""
    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return {"sliding_window": (None, sliding), "prefix_lm": (None, prefix_lm), "softcap": (softcap, None)}


def literal_mods(window: int, prefix: int, cap: float) -> dict:
    """The same mods with the numbers written in the code: constants of the generated kernels."""
    source = f'''
import torch
def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= {window})
def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < {prefix}) | (q_idx >= kv_idx)
def softcap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / {cap!r}) * {cap!r}
'''
    namespace: dict = {}
    path = f"<literal mods {window} {prefix} {cap}>"
    import linecache

    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    exec(compile(source, path, "exec"), namespace)
    return {"sliding_window": (None, namespace["sliding"]), "prefix_lm": (None, namespace["prefix_lm"]),
            "softcap": (namespace["softcap"], None)}


def triton_compilations() -> int:
    """Kernels Triton compiled in this process: the entries of every generated kernel's caches."""
    from flexattn.codegen import source as codegen_source

    total = 0
    for module in list(codegen_source._loaded.values()):
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if isinstance(caches, dict):
                for entry in caches.values():
                    total += len(entry[0]) if isinstance(entry, tuple) else 0
    return total


def compiles_once(device, dtype, head_dim: int) -> dict:
    """A window and a prefix that change at every step, at values of every kind Triton specialises
    on (1, multiples of 16, others): how many kernels that compiled after the first step."""
    from flexattn.codegen import source as codegen_source

    B, H, L = 1, 4, 2048
    q, k, v = (torch.randn(B, H, L, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    found = {}
    for case in ("sliding_window", "prefix_lm", "softcap"):
        counts = []
        for value in (256, 1, 300, 512, 17, 1024, 999):
            score, mask = runtime_mods(value, value, float(value) / 7 + 1)[case]
            bm = create_block_mask(mask, None, None, L, L, device=device) if mask else None
            flex_attention(q, k, v, score_mod=score, block_mask=bm).sum().backward()
            torch.cuda.synchronize()
            counts.append((triton_compilations(), len(codegen_source._loaded)))
        found[case] = {"after first step": counts[0], "after last step": counts[-1]}
    return found


def time_case(name, mods, q, k, v, bwd: bool, rep: int):
    import triton

    score, mask = mods[name]
    L = q.shape[2]
    bm = create_block_mask(mask, None, None, L, L, device=q.device) if mask else None
    grad = torch.randn_like(q)

    def fwd():
        return flex_attention(q, k, v, score_mod=score, block_mask=bm)

    def fwd_bwd():
        out = flex_attention(q, k, v, score_mod=score, block_mask=bm)
        torch.autograd.grad(out, (q, k, v), grad)

    fn = fwd_bwd if bwd else fwd
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"), bm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=60, help="ms of timed runs per measurement")
    parser.add_argument("--compiles-only", action="store_true")
    parser.add_argument("--skip-compiles", action="store_true", help="time only, without the compile-count check")
    parser.add_argument("--cases", nargs="+", choices=("sliding_window", "prefix_lm", "softcap"),
                        default=["sliding_window", "prefix_lm", "softcap"])
    parser.add_argument("--passes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    device, dtype = torch.device("cuda"), torch.bfloat16
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "compiles": {}, "rows": []}
    for d in [] if args.skip_compiles else args.head_dims:
        result["compiles"][d] = compiles_once(device, dtype, d)
        print(f"d={d} compilations (Triton, modules) after the first and the last of 7 values:",
              json.dumps(result["compiles"][d]), flush=True)
    if args.compiles_only:
        print(json.dumps(result, indent=1))
        return 0
    window, prefix, cap = 1024, 2048, 20.0
    print(f"{'case':16} {'d':>4} {'pass':8} {'runtime ms':>11} {'literal ms':>11} {'runtime/literal':>16} {'max diff':>9}")
    for d in args.head_dims:
        B, H = max(1, 256 * 2**20 // (SEQ * d * 2 * 16)), 16
        q, k, v = (torch.randn(B, H, SEQ, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        runtime, literal = runtime_mods(window, prefix, cap), literal_mods(window, prefix, cap)
        for name in args.cases:
            with torch.no_grad():
                a = flex_attention(q, k, v, score_mod=runtime[name][0],
                                   block_mask=create_block_mask(runtime[name][1], None, None, SEQ, SEQ, device=device)
                                   if runtime[name][1] else None)
                b = flex_attention(q, k, v, score_mod=literal[name][0],
                                   block_mask=create_block_mask(literal[name][1], None, None, SEQ, SEQ, device=device)
                                   if literal[name][1] else None)
            diff = (a.float() - b.float()).abs().max().item()
            for bwd in [p == "fwd+bwd" for p in args.passes]:
                times = {"runtime": [], "literal": []}
                for _ in range(args.rounds):  # alternating: the spread of each form is its own rounds'
                    for form, mods in (("runtime", runtime), ("literal", literal)):
                        times[form].append(time_case(name, mods, q, k, v, bwd, args.rep)[0])
                med = {f: statistics.median(t) for f, t in times.items()}
                row = {"case": name, "head_dim": d, "batch": B, "heads": H, "seq": SEQ, "pass": "fwd+bwd" if bwd else "fwd",
                       "runtime_ms": times["runtime"], "literal_ms": times["literal"], "ratio": med["runtime"] / med["literal"],
                       "max_abs_diff": diff}
                result["rows"].append(row)
                print(f"{name:16} {d:4} {row['pass']:8} {med['runtime']:11.3f} {med['literal']:11.3f} "
                      f"{row['ratio']:16.3f} {diff:9.2e}   runs {['%.3f' % t for t in times['runtime']]} "
                      f"{['%.3f' % t for t in times['literal']]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
