"""A warm eager call's host time on the CPU, with every kernel launch stubbed (docs/host_path.md).

    python -m benchmarks.host_proxy                    # every case, min and median of 5 rounds
    python -m benchmarks.host_proxy --calls 5000
    python -m benchmarks.host_proxy --cases decode decode_gqa   # some cases only
    python -m benchmarks.host_proxy --profile fwd_mask # cProfile of one case (SORT, TOP in the env)
    python -m benchmarks.host_proxy --profile fwd_mask --calls 1   # one warm call: its Python call count

The proxy of issue 52's warm call where no GPU is at hand: the same Python path as on a GPU, with
`launch` replaced in every module of flexattn/kernels/ that launches, by a counter (a case whose
count stays 0 never reached the kernels). It cannot see CUDA's launch cost, the device allocator or
stream queries: GPU host times come from `flexattn bench --mode host` on the device.

Cases (B 1, H 2, L 16, d 16, float32, BACKEND TRITON under Triton's interpreter): a forward with
ALiBi and a causal BlockMask; a forward without either; forward + backward of the first; a decode
step (q length 1, TRITON_DECODE); and the PYTORCH backend for reference. ``decode_gqa`` is the GPU
benchmark's decode step (flexattn/bench/host.py): ALiBi, 16 query heads on 2 key/value heads (GQA),
1024 cached keys, d 64, bfloat16; two splits, so a merge launch too, as on an H100.

``hopper_d128`` and ``hopper_d64`` are the GPU bench's masked forward (ALiBi + causal, B 1, H 4, L 256,
bfloat16, no options: AUTO) on CPU tensors taken for a Hopper's (``as_hopper``): ``Tensor.is_cuda``
answers True (a Python property here, C on a GPU: one more call each time it is read), no stream is
capturing, and the Gluon forward's problem reason is its shape rules only (the device's own facts
are a Hopper's). At head dim 128 the Gluon forward takes the call (its launch stubbed); at 64 AUTO's
rule leaves it to the portable forward after asking the Gluon forward's reasons, as on an H100.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from flexattn import create_block_mask, flex_attention  # noqa: E402

LAUNCHING_MODULES = ("forward", "backward", "decode", "transpose_tables", "hopper.forward", "hopper.backward")
launches: dict = {}


def stub_launches() -> None:
    """Every launch site of flexattn/kernels/ counts instead of launching (outputs stay as allocated)."""
    import importlib

    def counted(jit_fn, grid, args, constexprs):
        name = getattr(jit_fn, "__name__", None) or getattr(getattr(jit_fn, "fn", None), "__name__", "?")
        launches[name] = launches.get(name, 0) + 1

    for name in LAUNCHING_MODULES:
        importlib.import_module(f"flexattn.kernels.{name}").launch = counted


@contextlib.contextmanager
def as_hopper():
    """CPU tensors taken for a Hopper GPU's while inside (see the module docstring)."""
    import flexattn.kernels.hopper.common as hopper_common
    import flexattn.kernels.hopper.forward as hopper_forward

    saved = torch.Tensor.is_cuda, torch.cuda.is_current_stream_capturing, hopper_forward.problem_reason
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.is_current_stream_capturing = lambda: False
    hopper_forward.problem_reason = hopper_common.shape_reason
    try:
        yield
    finally:
        torch.Tensor.is_cuda, torch.cuda.is_current_stream_capturing, hopper_forward.problem_reason = saved


def cases() -> dict:
    """name -> (call, calls per timed call's weight: slower cases run fewer times, the context it runs in)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    q1 = torch.randn(1, 2, 1, 16)
    slopes = torch.randn(2)
    q16 = torch.randn(1, 16, 1, 64, dtype=torch.bfloat16)
    k16, v16 = (torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16) for _ in range(2))
    slopes16 = torch.randn(16)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def alibi16(score, b, h, q_idx, kv_idx):
        return score + slopes16[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = create_block_mask(causal, 1, 1, 16, 16, device="cpu")
    # The GPU bench's masked forward (flexattn/bench/host.py), at head dims 128 and 64.
    hopper = {D: tuple(torch.randn(1, 4, 256, D, dtype=torch.bfloat16) for _ in range(3)) for D in (128, 64)}
    slopes4 = torch.randn(4)
    bm256 = create_block_mask(causal, None, None, 256, 256, device="cpu")

    def alibi4(score, b, h, q_idx, kv_idx):
        return score + slopes4[h] * (kv_idx - q_idx)
    triton = {"BACKEND": "TRITON"}
    decode = {"BACKEND": "TRITON_DECODE"}  # what AUTO picks on a GPU for one query row; on the CPU it picks PYTORCH

    def fwd_bwd():
        out = flex_attention(qg, kg, vg, score_mod=alibi, block_mask=bm, kernel_options=triton)
        out.backward(out)  # a gradient the kernels read as it is (a sum's would be an expanded copy)

    plain = contextlib.nullcontext
    return {
        "fwd_mask": (lambda: flex_attention(q, k, v, score_mod=alibi, block_mask=bm, kernel_options=triton), 1, plain),
        "fwd_plain": (lambda: flex_attention(q, k, v, kernel_options=triton), 1, plain),
        "fwd_bwd": (fwd_bwd, 2, plain),
        "decode": (lambda: flex_attention(q1, k, v, score_mod=alibi, kernel_options=decode), 1, plain),
        "decode_gqa": (lambda: flex_attention(q16, k16, v16, score_mod=alibi16, enable_gqa=True, kernel_options=decode),
                       1, plain),
        "pytorch": (lambda: flex_attention(q, k, v, score_mod=alibi, block_mask=bm,
                                           kernel_options={"BACKEND": "PYTORCH"}), 5, plain),
        "hopper_d128": (lambda: flex_attention(*hopper[128], score_mod=alibi4, block_mask=bm256), 1, as_hopper),
        "hopper_d64": (lambda: flex_attention(*hopper[64], score_mod=alibi4, block_mask=bm256), 1, as_hopper),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (divided by the case's weight)")
    names = ["fwd_mask", "fwd_plain", "fwd_bwd", "decode", "decode_gqa", "pytorch", "hopper_d128", "hopper_d64"]
    parser.add_argument("--profile", choices=names)
    parser.add_argument("--cases", nargs="+", choices=names, default=names, help="the cases to time")
    args = parser.parse_args(argv)
    stub_launches()
    table = {name: case for name, case in cases().items() if name in args.cases or name == args.profile}
    for fn, _, context in table.values():  # the first calls trace, render and run the interpreter's kernels once
        with context():
            fn()
    if args.profile:
        fn, _, context = table[args.profile]
        with context():
            for _ in range(50):
                fn()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn()
            profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(os.environ.get("SORT", "tottime")).print_stats(
            int(os.environ.get("TOP", "25")))
        print(text.getvalue())
        return 0
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for name, (fn, weight, context) in table.items():
        n = max(1, args.calls // weight)
        with context():
            for _ in range(20):
                fn()
            launches.clear()
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                rounds.append((time.perf_counter() - start) / n * 1e6)
        per_call = {kernel: round(count / (5 * n), 2) for kernel, count in launches.items()}
        print(f"{name:10s} min {min(rounds):7.1f} us/call, median {sorted(rounds)[2]:7.1f} "
              f"(5 rounds of {n}); stubbed launches per call {per_call}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
