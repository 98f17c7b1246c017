"""What the benchmarks share: the timers (GPU time, and a warm call's host time), the block density a
TFLOP/s figure is scaled by, and the implementations flexattn is compared with (SDPA's kernels,
torch's compiled flex_attention)."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Optional

import torch

import flexattn

__all__ = ["KV_BYTES", "block_density", "bench", "host_us_per_call", "sdpa_fn", "dense_mask_sdpa", "compile_torch_flex",
           "git_commit"]

KV_BYTES = 256 * 2**20  # K (and V) bytes per forward case: the paper's setup


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


def host_us_per_call(fn, calls: int = 300, warmup: int = 3) -> float:
    """The host's time per call of ``fn`` (µs): the mean wall time of ``calls`` back-to-back calls with
    no synchronisation in the loop, on a warm ``fn``. Meaningful only where the GPU keeps up, i.e. on
    a problem small enough that the host is the bottleneck (flexattn/bench/host.py checks that)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def sdpa_fn(variant: str, q, k, v, backend_name: str):
    """SDPA on one backend for the variants it expresses (noop, causal), else None; with GQA (fewer key/value
    heads than query heads) through ``enable_gqa``, which a backend without it refuses when called."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
    if variant in ("noop", "causal"):
        causal = variant == "causal"
        gqa = q.shape[1] != k.shape[1]

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

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


def git_commit(where: Optional[str] = None) -> Optional[str]:
    """The checkout's commit, with "+changes" when tracked files differ from it: a copy of a working
    tree (the device's) may carry an older commit's git metadata under newer files."""
    try:
        here = where or os.path.dirname(os.path.abspath(__file__))

        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:
        return None
