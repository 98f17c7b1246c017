"""Forward benchmark in the FlexAttention paper's setup, side by side in one process.

    python -m flexattn.bench.forward --head-dims 64 128 --out results.json   # or: flexattn bench

The backward (training) benchmark is flexattn/bench/backward.py and the decoding one
flexattn/bench/decode.py; ``python -m flexattn.bench --mode fwd|bwd|decode`` runs any of them.

bf16, 16k tokens, batch x heads chosen so that K (and V) are 256 MiB each; the paper's seven
variants. For each: flexattn, torch's flex_attention under torch.compile, and SDPA (flash and cuDNN
where they express the variant; SDPA's memory-efficient kernel with a dense boolean mask where only
a mask expresses it). Times are medians of CUDA-event timings (triton.testing.do_bench); TFLOP/s use
4 * B * H * L * S * D * density, with density the fraction of (query, key) blocks the BlockMask
computes, the same count for every implementation.

``--portable`` also times flexattn pinned to its portable Triton template (``BACKEND: "TRITON"``),
beside the default choice (on Hopper, the Gluon kernels where they apply). ``--torch-flash`` also
times torch's flex_attention with ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4 kernels
generated from the same mods; needs the flash-attn-4 wheels, see ../shared/tools/flash4_wheels.sh);
a failure is recorded in the row, not fatal.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import flexattn
from flexattn.bench.common import KV_BYTES, bench, block_density, compile_torch_flex, dense_mask_sdpa, sdpa_fn
from flexattn.variants import CATALOGUE

# The paper's benchmark set by default; the catalogue holds many more, each runnable by name.
PAPER_VARIANTS = [name for name, variant in CATALOGUE.items() if variant.paper]
SEQ_LEN = 16384


def flexattn_path(call) -> str:
    """Which flexattn forward kernel ``call()`` runs: "gluon" (kernels/hopper/forward.py) or "portable"."""
    from flexattn.kernels.hopper import forward as hopper_forward

    before = hopper_forward.launches
    call()
    return "gluon" if hopper_forward.launches > before else "portable"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="default 64 128")
    parser.add_argument("--variants", nargs="+", default=PAPER_VARIANTS, choices=list(CATALOGUE), metavar="VARIANT",
                        help="default: the paper's seven (" + " ".join(PAPER_VARIANTS) + ")")
    parser.add_argument("--seq-len", type=int, default=None, help=f"default {SEQ_LEN}")
    parser.add_argument("--heads", type=int, default=None, help="default 16")
    parser.add_argument("--no-torch-flex", action="store_true", help="skip torch.compile(flex_attention)")
    parser.add_argument("--portable", action="store_true", help="also time flexattn's portable Triton template")
    parser.add_argument("--torch-flash", action="store_true",
                        help="also time torch's flex_attention with BACKEND FLASH (FlashAttention-4)")
    parser.add_argument("--out", default=None, help="write all numbers as JSON here")
    parser.add_argument("--kernel-options", default="{}", help="JSON FlexKernelOptions for flexattn")
    args = parser.parse_args(argv)
    args.head_dims = args.head_dims or [64, 128]
    args.seq_len = args.seq_len or SEQ_LEN
    args.heads = args.heads or 16
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2

    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    torch_flex_compiled = compile_torch_flex()
    options = json.loads(args.kernel_options)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
    }
    print(json.dumps(env))
    rows = []
    L = S = args.seq_len
    for D in args.head_dims:
        H = args.heads
        B = max(1, KV_BYTES // (H * S * D * 2))
        for name in args.variants:
            torch.manual_seed(0)
            q = torch.randn(B, H, L, D, device=device, dtype=dtype)
            k = torch.randn(B, H, S, D, device=device, dtype=dtype)
            v = torch.randn(B, H, S, D, device=device, dtype=dtype)
            score_mod, mask_mod = CATALOGUE[name].build(B, H, L, S, device)
            bm = flexattn.create_block_mask(mask_mod, None, None, L, S, device=device) if mask_mod else None
            density = block_density(bm) if bm is not None else 1.0
            flops = 4.0 * B * H * L * S * D * density
            row = {"variant": name, "B": B, "H": H, "L": L, "D": D, "density": round(density, 4)}

            ours = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, kernel_options=options)  # noqa: E731
            out = ours()
            row["flexattn_ms"] = bench(ours)
            row["flexattn_path"] = flexattn_path(ours)
            if args.portable:
                portable = {**options, "BACKEND": "TRITON"}
                pinned = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,  # noqa: E731
                                                         kernel_options=portable)
                row["rel_err_portable_vs_default"] = (
                    (pinned().float() - out.float()).norm() / out.float().norm()).item()
                row["flexattn_portable_ms"] = bench(pinned)

            if not args.no_torch_flex:
                tbm = torch_create_block_mask(mask_mod, None, None, L, S, device=device) if mask_mod else None
                theirs = lambda: torch_flex_compiled(q, k, v, score_mod=score_mod, block_mask=tbm)  # noqa: E731
                t0 = time.perf_counter()
                ref = theirs()
                torch.cuda.synchronize()
                row["torch_flex_compile_s"] = round(time.perf_counter() - t0, 2)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row["rel_err_vs_torch_flex"] = err
                row["torch_flex_ms"] = bench(theirs)
            if args.torch_flash:
                tbm = torch_create_block_mask(mask_mod, None, None, L, S, device=device) if mask_mod else None
                flash = lambda: torch_flex_compiled(q, k, v, score_mod=score_mod, block_mask=tbm,  # noqa: E731
                                                    kernel_options={"BACKEND": "FLASH"})
                try:
                    ref = flash()
                    row["rel_err_vs_torch_flash"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    row["torch_flash_ms"] = bench(flash)
                except Exception as err:  # no wheels, or a mod FLASH cannot take
                    row["torch_flash_error"] = str(err).strip().splitlines()[0][:160]
            for backend in ("flash", "cudnn"):
                fn = sdpa_fn(name, q, k, v, backend)
                if fn is not None:
                    try:
                        fn()
                        row[f"sdpa_{backend}_ms"] = bench(fn)
                    except RuntimeError as err:
                        row[f"sdpa_{backend}_ms"] = None
                        row[f"sdpa_{backend}_error"] = str(err).splitlines()[0][:120]
            if score_mod is None and mask_mod is not None and name not in ("causal",):
                try:
                    fn = dense_mask_sdpa(q, k, v, mask_mod, device)
                    fn()
                    row["sdpa_efficient_dense_ms"] = bench(fn)
                except RuntimeError as err:
                    row["sdpa_efficient_dense_error"] = str(err).splitlines()[0][:120]
            for key in [k for k in row if k.endswith("_ms") and row[k]]:
                row[key.replace("_ms", "_tflops")] = round(flops / (row[key] * 1e-3) / 1e12, 1)
            if row.get("torch_flex_ms"):
                row["speedup_vs_torch_flex"] = round(row["torch_flex_ms"] / row["flexattn_ms"], 3)
            if row.get("sdpa_cudnn_ms"):
                row["ratio_vs_cudnn"] = round(row["sdpa_cudnn_ms"] / row["flexattn_ms"], 3)
            if row.get("torch_flash_ms"):
                row["ratio_vs_torch_flash"] = round(row["torch_flash_ms"] / row["flexattn_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # write as we go: a crash later keeps the rows measured so far
                with open(args.out, "w") as f:
                    json.dump({"env": env, "rows": rows}, f, indent=1)
            del q, k, v
            torch.cuda.empty_cache()

    print()
    print("| variant | D | density | flexattn (path) TFLOP/s | portable | torch flex (Triton) | torch flex (FLASH) "
          "| SDPA cuDNN | x torch Triton | x torch FLASH | x cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def tf(key):
            return f"{r[key]:.0f}" if r.get(key) else "-"

        def ratio(key):
            return f"{r[key] / r['flexattn_ms']:.2f}x" if r.get(key) else "-"

        print(f"| {r['variant']} | {r['D']} | {r['density']:.3f} | {tf('flexattn_tflops')} ({r['flexattn_path']}) "
              f"| {tf('flexattn_portable_tflops')} | {tf('torch_flex_tflops')} | {tf('torch_flash_tflops')} "
              f"| {tf('sdpa_cudnn_tflops')} | {ratio('torch_flex_ms')} | {ratio('torch_flash_ms')} "
              f"| {ratio('sdpa_cudnn_ms')} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
