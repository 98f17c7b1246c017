"""The launch order's effect ([Note] Launch order in flexattn/kernels/launch_order.py): each case's
forward and backward in the grid's own order (TAIL_PAIRS = 1) and in the rule's, side by side in one
process on the same inputs. GPU only.

    python -m benchmarks.launch_order
    python -m benchmarks.launch_order --cases 4k_d64_causal_B4H12 --out order.json

Times are GPU times: every call is enqueued while a sleep kernel holds the GPU, so the host never
paces it (a 4k forward takes about as long on the GPU as its call on the host), and L2 is flushed
before each call, outside its events. Each figure is the median of CALLS calls, the best of ROUNDS
rounds, the two orders alternating. It also checks that both orders give the same bits (except where
the copy engine adds dQ in the dK/dV kernel, in an order that depends on scheduling: [Note] dQ in the
dK/dV kernel).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

CALLS = 15
ROUNDS = 4
SLEEP_CYCLES = 400_000_000  # about 0.2 s of GPU time: longer than the calls enqueued behind it

# name: (batch, heads, tokens, head dim, mask, kernel_options)
CASES = {
    "2k_d64_causal_B8H16": (8, 16, 2048, 64, "causal", None),
    "2k_d64_causal_B8H16_portable": (8, 16, 2048, 64, "causal", {"BACKEND": "TRITON"}),
    "4k_d64_causal_B4H12": (4, 12, 4096, 64, "causal", None),
    "4k_d64_causal_B4H12_portable": (4, 12, 4096, 64, "causal", {"BACKEND": "TRITON"}),
    "4k_d64_document_B4H12": (4, 12, 4096, 64, "document", None),
    "4k_d64_sliding_B4H12": (4, 12, 4096, 64, "sliding", None),
    "4k_d64_noop_B4H12": (4, 12, 4096, 64, "noop", None),
    "4k_d128_causal_B8H16": (8, 16, 4096, 128, "causal", None),
    "8k_d64_causal_B2H12": (2, 12, 8192, 64, "causal", None),
    "8k_d128_causal_B2H16": (2, 16, 8192, 128, "causal", None),
    "16k_d64_causal_B1H12": (1, 12, 16384, 64, "causal", None),
    "16k_d64_causal_B4H16": (4, 16, 16384, 64, "causal", None),
    "16k_d64_document_B4H16": (4, 16, 16384, 64, "document", None),
    "16k_d128_causal_B2H16": (2, 16, 16384, 128, "causal", None),
    "16k_d128_noop_B2H16": (2, 16, 16384, 128, "noop", None),
}


def _mask_mod(kind: str, length: int, device):
    from flexattn.variants import causal_mask

    if kind == "noop":
        return None
    if kind == "causal":
        return causal_mask
    if kind == "sliding":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < 1024)
    # Documents of random lengths between length / 32 and length / 4 tokens.
    generator = torch.Generator().manual_seed(1)
    lengths, left = [], length
    while left > 0:
        n = min(left, int(torch.randint(length // 32, length // 4, (), generator=generator)))
        lengths.append(n)
        left -= n
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    return lambda b, h, q, kv: doc[q] == doc[kv]


def _gpu_time(fn, flush: torch.Tensor) -> float:
    """Median GPU time of ``fn`` in ms ([module docstring])."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]
    torch.cuda._sleep(SLEEP_CYCLES)
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[CALLS // 2]


def run_case(name: str, flush: torch.Tensor) -> dict:
    from flexattn import create_block_mask, flex_attention
    from flexattn.kernels import launch_order
    from flexattn.kernels.hopper import backward as hopper_backward, forward as hopper_forward

    B, H, L, D, mask, options = CASES[name]
    device = torch.device("cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16)
    mask_mod = _mask_mod(mask, L, device)
    block_mask = create_block_mask(mask_mod, B, H, L, L, device=device) if mask_mod is not None else None
    kwargs = dict(block_mask=block_mask, kernel_options=options or {})
    rule = launch_order._cached_tail
    orders = {"grid": lambda *args: 1, "rule": rule}
    result = {"case": name, "B": B, "H": H, "L": L, "D": D, "mask": mask, "kernel_options": options or {},
              "rule_tail_pairs": launch_order.tail_pairs((L // 128, H, B), device, rows_alike=mask_mod is None)}
    bits = {}
    try:
        for order, tail in orders.items():
            launch_order._cached_tail = tail
            forward_before, backward_before = hopper_forward.launches, hopper_backward.launches
            out = flex_attention(q, k, v, **kwargs)
            bits[order] = [out] + list(torch.autograd.grad(out, (q, k, v), dout))
            result["gluon forward, backward"] = [hopper_forward.launches > forward_before,
                                                 hopper_backward.launches > backward_before]
        result["same bits (out, dq, dk, dv)"] = [torch.equal(a, b) for a, b in zip(bits["grid"], bits["rule"])]
        out = flex_attention(q, k, v, **kwargs)
        timed = {"forward": lambda: flex_attention(q, k, v, **kwargs),
                 "backward": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)}
        for _ in range(ROUNDS):
            for order, tail in orders.items():
                launch_order._cached_tail = tail
                for what, fn in timed.items():
                    ms = _gpu_time(fn, flush)
                    key = f"{order} {what} ms"
                    result[key] = min(result.get(key, ms), ms)
    finally:
        launch_order._cached_tail = rule
    for what in ("forward", "backward"):
        result[f"{what} speedup"] = result[f"grid {what} ms"] / result[f"rule {what} ms"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launch_order", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m benchmarks.launch_order times GPU kernels: no CUDA device here", file=sys.stderr)
        return 2
    import triton

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")  # larger than any L2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, bf16")
    print("| case | tail pairs | forward ms (grid order / rule) | x | backward ms (grid order / rule) | x "
          "| same bits |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for name in args.cases:
        r = run_case(name, flush)
        results.append(r)
        print(f"| {name} | {r['rule_tail_pairs']} | {r['grid forward ms']:.3f} / {r['rule forward ms']:.3f} | "
              f"{r['forward speedup']:.3f} | {r['grid backward ms']:.3f} / {r['rule backward ms']:.3f} | "
              f"{r['backward speedup']:.3f} | {all(r['same bits (out, dq, dk, dv)'])} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
