"""Decode benchmark: one query token against a long KV cache, side by side in one process.

    python -m flexattn.bench.decode --out decode.json

bf16. Every implementation is timed as a CUDA-graph replay of its call (how a serving loop runs a
decoding step; eager times are kept too, as *_eager_ms). For each case: flexattn (the split-KV decode kernel, chosen automatically for short queries),
torch's flex_attention under torch.compile(dynamic=False), and SDPA flash on K/V expanded to the
query heads (noop only; a reference point that reads the expanded copy). Reported: median ms
(triton.testing.do_bench), the K and V bytes read once over the kernel time (GB/s) and its share of
the copy bandwidth measured here (a device-to-device copy, read + write bytes over time), the same
over the GPU time of flexattn's kernels alone (CUDA profiler, L2 flushed before each step), the
ceiling that the cache's size allows (the fastest of a few kernels that only stream the same K and
V bytes, timed both ways), the speed-up over torch, a paged run (flexattn.PagedAttention: the same cache scattered over pages)
against the contiguous one, and the host time of a warm call (a small problem, calls enqueued back
to back, wall time per call).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

import flexattn
from flexattn import create_block_mask, flex_attention
from flexattn.bench.common import host_us_per_call
from flexattn.variants import generate_alibi_bias, generate_tanh_softcap

# (B, Hq, Hkv, S, D): MHA, GQA 16:2 and 12:2, 16k to 128k keys, B=8 and B=1.
CASES = [
    (8, 16, 16, 16384, 64),
    (8, 16, 2, 131072, 64),
    (8, 12, 2, 32768, 128),
    (8, 16, 2, 16384, 128),
    (1, 16, 2, 131072, 128),
    (1, 12, 2, 65536, 64),
]
VARIANTS = ("noop", "alibi", "softcap")


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_us(fn, name: str, steps: int = 20) -> float:
    """Median GPU time per call of the kernels whose names contain ``name`` (CUDA profiler), the L2
    cache flushed before each call: the kernels alone, without launch gaps or graph overhead."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")  # 256 MiB, more than any L2
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if name in e.name), key=lambda e: e.time_range.start)
    per_call = len(kernels) // steps
    if per_call == 0:
        raise RuntimeError(f"the profiler saw no kernel named like {name!r}")
    totals = sorted(sum(e.time_range.end - e.time_range.start for e in kernels[i * per_call:(i + 1) * per_call])
                    for i in range(steps))
    return totals[steps // 2]


def _stream_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(X, Y, OUT, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """Sum ITERS x BLOCK elements of X and of Y: nothing but reading the bytes once."""
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.range(0, ITERS, num_stages=4):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
            acc += tl.load(Y + offs, mask=offs < N, other=0.0).to(tl.float32)
        tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))

    return stream_read


# (elements per step, steps per program, warps, stages): the fastest of a sweep at the cache sizes of
# docs/benchmarks.md, "Decoding" (34 MB, 134 MB and 537 MB), whose "a read's ceiling" column they give.
READ_CONFIGS = [(16384, 4, 16, 2), (4096, 64, 8, 4), (4096, 16, 8, 4)]


def read_ceiling(k: torch.Tensor, v: torch.Tensor) -> dict:
    """The fastest of READ_CONFIGS at reading k and v once (both contiguous, same size): what a kernel
    that does nothing else achieves at this size, as kernel time and as a graph-timed step."""
    import triton

    stream_read = _stream_read_kernel()
    n = k.numel()
    best = None
    for block, iters, warps, stages in READ_CONFIGS:
        grid = (triton.cdiv(n, block * iters),)
        out = torch.empty(grid[0], device="cuda")
        run = lambda: stream_read[grid](k, v, out, n, BLOCK=block, ITERS=iters, num_warps=warps,  # noqa: E731
                                        num_stages=stages)
        us = kernel_us(run, "stream_read")
        if best is None or us < best[0]:
            best = (us, run)
    return {"read_kernel_us": best[0], "read_graph_ms": bench(graphed(best[1]))}


def _decode_launches():
    try:
        import flexattn.kernels.decode as decode
    except ImportError:
        return None
    return decode.launches


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def score_mod_of(variant: str, Hq: int):
    if variant == "alibi":
        return generate_alibi_bias(Hq, "cuda")
    if variant == "softcap":
        return generate_tanh_softcap(20.0)
    return None


def graphed(fn):
    """``fn`` captured in a CUDA graph (warmed up on a side stream first), as a serving loop runs a
    decoding step: the replay costs a few microseconds of host time, so the timing is the GPU's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def paged_case(q, k, v, score_mod, page_size: int = 128):
    """flexattn on a paged copy of (k, v): pages handed out in a shuffled order, so the physical
    layout differs from the logical one; returns (paged callable, contiguous callable with the same
    logical mask): the paged run pays for the mask as well as for the pages, so the fair baseline for
    "what paging costs" is the contiguous cache under the same mask."""
    B, Hkv, S, D = k.shape
    pages_per_seq = S // page_size
    paged = flexattn.PagedAttention(B * pages_per_seq, page_size, B, device="cuda")
    k_cache = torch.zeros(1, Hkv, B * pages_per_seq * page_size, D, dtype=k.dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(B)
    for b in order.tolist():
        paged.reserve(torch.tensor(b, device="cuda"), torch.tensor(S, device="cuda"))
    paged.assign(torch.arange(B, device="cuda"), torch.arange(S, device="cuda").expand(B, S), k, v, k_cache, v_cache)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, B, 1, 1, S, device="cuda")
    physical = paged.convert_logical_block_mask(logical)
    paged_score = paged.get_score_mod(score_mod) if score_mod is not None else None
    enable_gqa = q.shape[1] != Hkv

    def run():
        return flex_attention(q, k_cache, v_cache, score_mod=paged_score, block_mask=physical, enable_gqa=enable_gqa)

    def contiguous():
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=logical, enable_gqa=enable_gqa)

    return run, contiguous


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--no-torch-flex", action="store_true", help="skip torch's compiled flex_attention")
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flexattn.bench.decode times GPU kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "dtype": "bfloat16"}
    env["copy_GBps"] = round(copy_bandwidth(), 1)
    print(f"{env['device']}: copy bandwidth {env['copy_GBps']} GB/s (read + write)", flush=True)
    torch_flex = None
    if not args.no_torch_flex:
        from flexattn.bench.common import compile_torch_flex

        torch_flex = compile_torch_flex()
    rows = []
    for B, Hq, Hkv, S, D in CASES[: args.cases]:
        torch.manual_seed(0)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * k.numel() * k.element_size()
        gqa = Hq != Hkv
        # A small cache is read in a few microseconds, where even a copy falls short of the 1 GiB
        # copy's bandwidth: a copy of these K and V, graph-timed, says what this size allows.
        k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)

        def copy_kv():
            k_copy.copy_(k)
            v_copy.copy_(v)

        same_size_copy_GBps = 2 * kv_bytes / bench(graphed(copy_kv)) / 1e6
        del k_copy, v_copy
        ceiling = read_ceiling(k, v)
        for variant in VARIANTS:
            score_mod = score_mod_of(variant, Hq)
            row = {"variant": variant, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D}
            launches = _decode_launches()
            ours = lambda: flex_attention(q, k, v, score_mod=score_mod, enable_gqa=gqa)  # noqa: E731
            out = ours()
            row["decode_kernel_ran"] = launches is not None and _decode_launches() > launches
            row["flexattn_eager_ms"] = bench(ours)
            ms = bench(graphed(ours))
            row["flexattn_ms"] = ms
            row["flexattn_GBps"] = kv_bytes / ms / 1e6
            row["flexattn_copy_share"] = row["flexattn_GBps"] / env["copy_GBps"]
            row["same_size_copy_GBps"] = same_size_copy_GBps
            row["flexattn_same_size_copy_share"] = row["flexattn_GBps"] / same_size_copy_GBps
            row["flexattn_kernel_us"] = kernel_us(ours, "flex_attention_decode")
            row["flexattn_kernel_copy_share"] = kv_bytes / row["flexattn_kernel_us"] / 1e3 / env["copy_GBps"]
            row["read_ceiling_kernel_share"] = kv_bytes / ceiling["read_kernel_us"] / 1e3 / env["copy_GBps"]
            row["read_ceiling_graph_share"] = kv_bytes / ceiling["read_graph_ms"] / 1e6 / env["copy_GBps"]
            if torch_flex is not None:
                try:
                    theirs = lambda: torch_flex(q, k, v, score_mod=score_mod, enable_gqa=gqa)  # noqa: E731
                    ref = theirs()
                    row["torch_flex_eager_ms"] = bench(theirs)
                    try:
                        row["torch_flex_ms"] = bench(graphed(theirs))
                    except Exception as err:  # compiled code that cannot be captured: its eager time
                        row["torch_flex_graph_error"] = str(err)[:200]
                        row["torch_flex_ms"] = row["torch_flex_eager_ms"]
                    row["speedup_vs_torch_flex"] = row["torch_flex_ms"] / ms
                    row["max_abs_diff_vs_torch_flex"] = (out.float() - ref.float()).abs().max().item()
                except Exception as err:  # a compile or memory failure is recorded, not fatal
                    row["torch_flex_error"] = str(err)[:200]
            if variant == "noop":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                import torch.nn.functional as F

                try:
                    ke = k.repeat_interleave(Hq // Hkv, dim=1)
                    ve = v.repeat_interleave(Hq // Hkv, dim=1)

                    def sdpa():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(q, ke, ve)

                    row["sdpa_flash_expanded_ms"] = bench(sdpa)
                    del ke, ve
                except Exception as err:
                    row["sdpa_flash_error"] = str(err)[:200]
            if variant in ("noop", "alibi") and S % 128 == 0:
                try:
                    run, contiguous = paged_case(q, k, v, score_mod)
                    paged_out = run()
                    row["paged_ms"] = bench(graphed(run))
                    contiguous()
                    row["masked_contiguous_ms"] = bench(graphed(contiguous))
                    row["paged_over_contiguous"] = row["paged_ms"] / row["masked_contiguous_ms"]
                    row["paged_over_contiguous_kernels"] = (kernel_us(run, "flex_attention_decode")
                                                            / kernel_us(contiguous, "flex_attention_decode"))
                    row["paged_over_unmasked"] = row["paged_ms"] / ms
                    row["paged_max_abs_diff"] = (paged_out.float() - out.float()).abs().max().item()
                except Exception as err:
                    row["paged_error"] = str(err)[:200]
            print(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}), flush=True)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    # Host time of a warm call: a problem small enough that the GPU never holds the host back
    # (`flexattn bench --mode host` measures it with ALiBi too, and checks the GPU keeps up).
    q = torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1024, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    env["flexattn_host_us"] = host_us_per_call(lambda: flex_attention(q, k, v, enable_gqa=True))
    # The same step captured in a CUDA graph, replayed.
    step = graphed(lambda: flex_attention(q, k, v, enable_gqa=True))
    env["flexattn_graph_replay_host_us"] = host_us_per_call(step)
    if torch_flex is not None:
        env["torch_flex_host_us"] = host_us_per_call(lambda: torch_flex(q, k, v, enable_gqa=True))
    print(json.dumps(env), flush=True)
    print("\n| variant | B | Hq:Hkv | S | d | flexattn ms | GB/s | of copy bw | a read's ceiling | kernels us | "
          "of copy bw | a read's ceiling | torch flex ms | speed-up | paged / contiguous (same mask) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['B']} | {r['Hq']}:{r['Hkv']} | {r['S']} | {r['D']} | {r['flexattn_ms']:.3f} | "
              f"{r['flexattn_GBps']:.0f} | {r['flexattn_copy_share']:.0%} | {r['read_ceiling_graph_share']:.0%} | "
              f"{r['flexattn_kernel_us']:.1f} | {r['flexattn_kernel_copy_share']:.0%} | {r['read_ceiling_kernel_share']:.0%} | "
              f"{r.get('torch_flex_ms', float('nan')):.3f} | "
              f"{r.get('speedup_vs_torch_flex', float('nan')):.2f}x | {r.get('paged_over_contiguous', float('nan')):.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
