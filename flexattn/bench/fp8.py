"""FP8 attention side by side in one process: the forward on FP8 query, key and value, and decoding
from an FP8 key/value cache.

    python -m flexattn.bench.fp8 --head-dims 64 128 --out fp8.json     # or: flexattn bench --mode fp8

**Forward.** 16k tokens, B x 16 heads with K and V of 256 MiB in bf16 (the forward benchmark's
setup). The float32 inputs are quantized per tensor to e4m3 (scale = amax / 448); the query's and
key's scales fold into ``scale`` and the value's multiplies the output, as torch's flex_attention
takes FP8 ([Note] Mixed and FP8 dtypes in flexattn/request.py). Timed (``do_bench`` medians):
- flexattn on FP8, V column-major (the layout torch's flex_attention gives FP8 values) and V
  row-major (flexattn copies it to column-major first: the copy is in the time);
- flexattn on bf16 (its default path);
- torch's compiled flex_attention on the same FP8 tensors (V column-major) and on bf16;
- SDPA cuDNN on bf16 (noop and causal).
TFLOP/s count 4 B H L S D times the BlockMask's density. Errors: norm-wise relative error of the
output (scaled back) against float64 attention of the unquantized inputs, over the last (batch,
head) and its last 2048 query rows; the FP8 error beside the bf16 error is the error budget.

**Decoding.** One bf16 query token per sequence, GQA 32:8, d=128, caches of 32k and 128k tokens in
bf16 and in e4m3 (scales as above). flexattn's decode kernels and torch's compiled flex_attention,
each captured in a CUDA graph (as a serving loop runs a step); GB/s count the K and V bytes read.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys

import torch

import flexattn
from flexattn.bench.common import KV_BYTES, bench, block_density, compile_torch_flex, sdpa_fn
from flexattn.bench.decode import graphed
from flexattn.variants import CATALOGUE

E4M3 = torch.float8_e4m3fn
SEQ_LEN = 16384
FORWARD_VARIANTS = ["noop", "causal", "alibi", "sliding_window", "prefix_lm", "document_mask", "softcap"]
DECODE_CASES = [(8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128)]  # (B, Hq, Hkv, S, D)
REF_ROWS = 2048


def quantize(t: torch.Tensor, dtype=E4M3):
    """``(t / s).to(dtype), s`` with the per-tensor scale s = amax / (dtype's largest value)."""
    scale = t.abs().amax().float().clamp_min(1e-12) / torch.finfo(dtype).max
    return (t / scale).to(dtype), scale


def column_major(v: torch.Tensor) -> torch.Tensor:
    return v.transpose(-2, -1).contiguous().transpose(-2, -1)


def reference_rows(q, k, v, score_mod, mask_mod, scale, rows):
    """float64 attention of the last (batch, head) for its last ``rows`` queries: [rows, Ev]."""
    b, h = q.shape[0] - 1, q.shape[1] - 1
    L, S = q.shape[2], k.shape[2]
    kv_h = h // (q.shape[1] // k.shape[1])
    qs = q[b, h, L - rows:].double()
    s = qs @ k[min(b, k.shape[0] - 1), kv_h].double().T * scale
    dev = q.device
    q_idx = torch.arange(L - rows, L, device=dev)[:, None]
    kv_idx = torch.arange(S, device=dev)[None, :]
    b_t, h_t = torch.tensor(b, device=dev), torch.tensor(h, device=dev)
    if score_mod is not None:
        s = score_mod(s, b_t, h_t, q_idx, kv_idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b_t, h_t, q_idx, kv_idx), -math.inf)
    return s.softmax(-1) @ v[min(b, v.shape[0] - 1), kv_h].double()


def rel_err(out: torch.Tensor, ref: torch.Tensor, rows: int, out_scale=1.0) -> float:
    mine = out[-1, -1, -rows:].double() * float(out_scale)
    return ((mine - ref).norm() / ref.norm()).item()


def _env() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "cuda": torch.version.cuda}


def _timed(row: dict, name: str, fn, flops: float, ref, out_scale=1.0, timer=bench):
    """Run ``fn`` once for its error, then time it; a failure is recorded in the row."""
    try:
        out = fn()
        row[f"{name}_err"] = round(rel_err(out, ref, min(REF_ROWS, out.shape[2]), out_scale), 5)
        ms = timer(fn)
    except Exception as err:  # noqa: BLE001 - a case one implementation cannot run is a result too
        row[f"{name}_error"] = str(err).strip().splitlines()[0][:200]
        return
    row[f"{name}_ms"] = round(ms, 4)
    row[f"{name}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)


def forward_rows(head_dims, variants, torch_flex, out_path, env) -> list:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    rows = []
    dev = torch.device("cuda")
    L = S = SEQ_LEN
    for D in head_dims:
        H = 16
        B = max(1, KV_BYTES // (H * S * D * 2))
        for name in variants:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, n, D, device=dev) for n in (L, S, S))
            score_mod, mask_mod = CATALOGUE[name].build(B, H, L, S, dev)
            bm = flexattn.create_block_mask(mask_mod, None, None, L, S, device=dev) if mask_mod else None
            tbm = torch_create_block_mask(mask_mod, None, None, L, S, device=dev) if mask_mod else None
            density = block_density(bm) if bm is not None else 1.0
            flops = 4.0 * B * H * L * S * D * density
            softmax_scale = 1.0 / math.sqrt(D)
            ref = reference_rows(q, k, v, score_mod, mask_mod, softmax_scale, REF_ROWS)
            (q8, sq), (k8, sk), (v8, sv) = quantize(q), quantize(k), quantize(v)
            v8c = column_major(v8)
            scale8 = float(sq * sk) * softmax_scale
            q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
            del q, k, v
            row = {"variant": name, "B": B, "H": H, "L": L, "D": D, "density": round(density, 4)}

            def ours(qq, kk, vv, s):
                return lambda: flexattn.flex_attention(qq, kk, vv, score_mod=score_mod, block_mask=bm, scale=s)

            def theirs(qq, kk, vv, s):
                return lambda: torch_flex(qq, kk, vv, score_mod=score_mod, block_mask=tbm, scale=s)

            _timed(row, "flexattn_fp8", ours(q8, k8, v8c, scale8), flops, ref, sv)
            _timed(row, "flexattn_fp8_rowv", ours(q8, k8, v8, scale8), flops, ref, sv)
            _timed(row, "flexattn_bf16", ours(q16, k16, v16, None), flops, ref)
            _timed(row, "torch_flex_fp8", theirs(q8, k8, v8c, scale8), flops, ref, sv)
            _timed(row, "torch_flex_bf16", theirs(q16, k16, v16, None), flops, ref)
            cudnn = sdpa_fn(name, q16, k16, v16, "cudnn")
            if cudnn is not None:
                _timed(row, "sdpa_cudnn_bf16", cudnn, flops, ref)
            ms = row.get("flexattn_fp8_ms")
            for other in ("flexattn_bf16", "torch_flex_fp8", "torch_flex_bf16", "sdpa_cudnn_bf16"):
                if ms and row.get(f"{other}_ms"):
                    row[f"x_{other}"] = round(row[f"{other}_ms"] / ms, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _save(out_path, env, rows, [])
            del q8, k8, v8, v8c, q16, k16, v16
            torch.cuda.empty_cache()
    return rows


def decode_rows(torch_flex, out_path, env, forward) -> list:
    rows = []
    dev = torch.device("cuda")
    for B, Hq, Hkv, S, D in DECODE_CASES:
        torch.manual_seed(0)
        q = torch.randn(B, Hq, 1, D, device=dev)
        k = torch.randn(B, Hkv, S, D, device=dev)
        v = torch.randn(B, Hkv, S, D, device=dev)
        softmax_scale = 1.0 / math.sqrt(D)
        ref = reference_rows(q, k, v, None, None, softmax_scale, 1)
        (k8, sk), (v8, sv) = quantize(k), quantize(v)
        q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
        del k, v
        row = {"B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D}
        for cache, kk, vv, s, out_scale in (("bf16", k16, v16, softmax_scale, 1.0),
                                            ("fp8", k8, v8, float(sk) * softmax_scale, sv)):
            kv_bytes = 2 * kk.numel() * kk.element_size()
            for name, fn in (
                ("flexattn", lambda: flexattn.flex_attention(q16, kk, vv, scale=s, enable_gqa=True)),
                ("torch_flex", lambda: torch_flex(q16, kk, vv, scale=s, enable_gqa=True)),
            ):
                key = f"{name}_{cache}"
                try:
                    out = fn()
                    row[f"{key}_err"] = round(rel_err(out, ref, 1, out_scale), 5)
                    ms = bench(graphed(fn))
                    row[f"{key}_ms"] = round(ms, 4)
                    row[f"{key}_GBps"] = round(kv_bytes / (ms * 1e-3) / 1e9, 1)
                except Exception as err:  # noqa: BLE001
                    row[f"{key}_error"] = str(err).strip().splitlines()[0][:200]
        if row.get("flexattn_fp8_ms") and row.get("flexattn_bf16_ms"):
            row["x_flexattn_bf16"] = round(row["flexattn_bf16_ms"] / row["flexattn_fp8_ms"], 3)
        if row.get("flexattn_fp8_ms") and row.get("torch_flex_fp8_ms"):
            row["x_torch_flex_fp8"] = round(row["torch_flex_fp8_ms"] / row["flexattn_fp8_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _save(out_path, env, forward, rows)
    return rows


def _save(path, env, forward, decode) -> None:
    if path:  # written as it goes: a crash later keeps the rows measured so far
        with open(path, "w") as f:
            json.dump({"env": env, "forward": forward, "decode": decode}, f, indent=1)


def _tables(forward, decode) -> None:
    def tf(r, key):
        return f"{r[key]:.0f}" if r.get(key) else "-"

    def x(r, key):
        return f"{r[key]:.2f}x" if r.get(key) else "-"

    def errors(r):
        return (f"{r['flexattn_fp8_err']:.4f} / {r['flexattn_bf16_err']:.4f}"
                if "flexattn_fp8_err" in r and "flexattn_bf16_err" in r else "-")

    print("\n| variant | D | density | flexattn FP8 | FP8, V row-major | flexattn bf16 | torch flex FP8 | torch flex bf16 "
          "| cuDNN bf16 | x flexattn bf16 | x torch FP8 | x cuDNN | error FP8 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in forward:
        print(f"| {r['variant']} | {r['D']} | {r['density']:.3f} | {tf(r, 'flexattn_fp8_tflops')} "
              f"| {tf(r, 'flexattn_fp8_rowv_tflops')} | {tf(r, 'flexattn_bf16_tflops')} | {tf(r, 'torch_flex_fp8_tflops')} "
              f"| {tf(r, 'torch_flex_bf16_tflops')} | {tf(r, 'sdpa_cudnn_bf16_tflops')} | {x(r, 'x_flexattn_bf16')} "
              f"| {x(r, 'x_torch_flex_fp8')} | {x(r, 'x_sdpa_cudnn_bf16')} | {errors(r)} |")
    print("\n| B | Hq:Hkv | S | D | flexattn bf16 cache GB/s | flexattn FP8 cache | torch flex bf16 | torch flex FP8 "
          "| x flexattn bf16 | x torch FP8 | error FP8 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in decode:
        print(f"| {r['B']} | {r['Hq']}:{r['Hkv']} | {r['S']} | {r['D']} | {tf(r, 'flexattn_bf16_GBps')} "
              f"| {tf(r, 'flexattn_fp8_GBps')} | {tf(r, 'torch_flex_bf16_GBps')} | {tf(r, 'torch_flex_fp8_GBps')} "
              f"| {x(r, 'x_flexattn_bf16')} | {x(r, 'x_torch_flex_fp8')} | {errors(r)} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--variants", nargs="+", default=FORWARD_VARIANTS, choices=list(CATALOGUE), metavar="VARIANT",
                        help="default: " + " ".join(FORWARD_VARIANTS))
    parser.add_argument("--skip", choices=("forward", "decode"), default=None, help="leave one part out")
    parser.add_argument("--out", default=None, help="write all numbers as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < (8, 9):
        print("FP8 products need compute capability 8.9 or newer (Ada, Hopper)", file=sys.stderr)
        return 2
    env = _env()
    print(json.dumps(env))
    torch_flex = compile_torch_flex()
    forward = [] if args.skip == "forward" else forward_rows(args.head_dims, args.variants, torch_flex, args.out, env)
    decode = [] if args.skip == "decode" else decode_rows(torch_flex, args.out, env, forward)
    _tables(forward, decode)
    _save(args.out, env, forward, decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
