"""Forward benchmark in the FlexAttention paper's setup, side by side in one process.

    python -m flexattn.gym.benchmark --head-dims 64 128 --out results.json
    python -m flexattn.gym.benchmark --mode bwd --out results_bwd.json   # forward + backward

``--mode bwd`` runs the training benchmark of ``flexattn/gym/benchmark_training.py`` (its docstring says what
it measures); what follows describes the forward mode, the default.

bf16, 16k tokens, batch x heads chosen so that K (and V) are 256 MiB each; the paper's seven
variants. For each: flexattn, torch's flex_attention under torch.compile, and SDPA (flash and cuDNN
where they express the variant; SDPA's memory-efficient kernel with a dense boolean mask where only
a mask expresses it). Times are medians of CUDA-event timings (triton.testing.do_bench); TFLOP/s use
4 * B * H * L * S * D * density, with density the fraction of (query, key) blocks the BlockMask
computes, the same count for every implementation.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import flexattn
from flexattn.variants import CATALOGUE

KV_BYTES = 256 * 2**20
# The paper's benchmark set by default; the catalogue holds many more, each runnable by name.
PAPER_VARIANTS = [name for name, variant in CATALOGUE.items() if variant.paper]
SEQ_LEN = 16384


def block_density(block_mask) -> float:
    q_len, kv_len = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE
    blocks = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        blocks += block_mask.full_kv_num_blocks.sum().item()
    per_head = blocks / (block_mask.kv_num_blocks.shape[0] * block_mask.kv_num_blocks.shape[1])
    return min(1.0, per_head * bq * bkv / (q_len * kv_len))


def bench(fn, rep_ms: int = 200) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def sdpa_fn(variant: str, q, k, v, backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
    if variant in ("noop", "causal"):
        causal = variant == "causal"

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run
    return None


def dense_mask_sdpa(q, k, v, mask_mod, device):
    """SDPA's memory-efficient kernel with a dense [L, S] boolean mask built from the mask_mod."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    dense = flexattn.create_mask(mask_mod, 1, 1, q.shape[2], k.shape[2], device=device)

    def run():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    return run


def compile_torch_flex():
    """torch's flex_attention under torch.compile(dynamic=False), with Dynamo's recompile limits lifted:
    every (variant, head dim) is a new specialisation, and none may silently fall back to the unfused path."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex
    from torch import _dynamo

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(_dynamo.config, name):
            setattr(_dynamo.config, name, 1024)
    # The backward is timed by calling autograd.grad repeatedly on one graph (retain_graph=True);
    # donated buffers (on by default in torch 2.11's AOTAutograd) forbid that for some shapes.
    from torch._functorch import config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(torch_flex, dynamic=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("fwd", "bwd"), default="fwd",
                        help="fwd: forward only (default); bwd: forward and backward (flexattn/gym/benchmark_training.py)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="default 64 128")
    parser.add_argument("--variants", nargs="+", default=PAPER_VARIANTS, choices=list(CATALOGUE), metavar="VARIANT",
                        help="default: the paper's seven (" + " ".join(PAPER_VARIANTS) + ")")
    parser.add_argument("--seq-len", type=int, default=None, help=f"default {SEQ_LEN}")
    parser.add_argument("--heads", type=int, default=None, help="default 16")
    parser.add_argument("--no-torch-flex", action="store_true", help="skip torch.compile(flex_attention)")
    parser.add_argument("--out", default=None, help="write all numbers as JSON here")
    parser.add_argument("--kernel-options", default="{}", help="JSON FlexKernelOptions for flexattn")
    training = parser.add_argument_group("--mode bwd only")
    training.add_argument("--batch", type=int, default=None, help="default: K and V 128 MiB each (B4 at d=64, B2 at d=128)")
    training.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    training.add_argument("--rep", type=float, default=100, help="do_bench budget per timing, ms (default 100)")
    training.add_argument("--min-reps", type=int, default=5, help="at least this many timed calls (default 5)")
    training.add_argument("--grad-tol", type=float, default=2e-2,
                          help="flag gradients whose relative error against torch's exceeds this (default 2e-2)")
    training.add_argument("--oracle-floor", type=float, default=5e-3,
                          help="flexattn's error against the float32 oracle may reach max(2x torch's, this)")
    training.add_argument("--no-oracle", dest="oracle", action="store_false",
                          help="skip the float32 oracle on one (batch, head) slice")
    training.add_argument("--smoke", action="store_true",
                          help="tiny sizes (256 tokens, B1 H2 d32 unless given) that run on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.mode == "bwd":
        from flexattn.gym.benchmark_training import run

        return run(args)
    if args.smoke or args.batch:
        parser.error("--smoke and --batch belong to --mode bwd; the forward mode keeps its paper shapes")
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
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # write as we go: a crash later keeps the rows measured so far
                with open(args.out, "w") as f:
                    json.dump({"env": env, "rows": rows}, f, indent=1)
            del q, k, v
            torch.cuda.empty_cache()

    print()
    header = f"{'variant':<15}{'D':>4}{'dens':>6}{'ours ms':>9}{'TF/s':>7}{'torch ms':>9}{'TF/s':>7}{'x torch':>8}{'cudnn ms':>9}{'flash ms':>9}{'err':>9}"
    print(header)
    for r in rows:
        print(
            f"{r['variant']:<15}{r['D']:>4}{r['density']:>6.2f}{r['flexattn_ms']:>9.2f}{r.get('flexattn_tflops', 0):>7.0f}"
            f"{r.get('torch_flex_ms') or float('nan'):>9.2f}{r.get('torch_flex_tflops') or 0:>7.0f}"
            f"{r.get('speedup_vs_torch_flex') or float('nan'):>8.2f}{r.get('sdpa_cudnn_ms') or float('nan'):>9.2f}"
            f"{r.get('sdpa_flash_ms') or float('nan'):>9.2f}{r.get('rel_err_vs_torch_flex', float('nan')):>9.1e}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
