"""Training benchmark: forward and backward in the FlexAttention paper's setup, side by side in one process.

    python -m flexattn.bench.backward --out bench_bwd.json            # or: flexattn bench --mode bwd
    python -m flexattn.bench.backward --head-dims 128 --variants causal document_mask \
        --heads 32:8 8:1 --seq-len 8192 32768 --torch-flash              # grouped-query attention
    TRITON_INTERPRET=1 python -m flexattn.bench.backward --smoke      # CPU: code paths only

bf16, 16k tokens, 16 heads, batch chosen so that Q (and K and V) are 128 MiB each: B = 4 at d = 64
and B = 2 at d = 128 (issue 9; the forward benchmark uses 256 MiB). The paper's seven variants. For
each, in one process: flexattn, torch's flex_attention under torch.compile(dynamic=False) with a torch
BlockMask from torch's create_block_mask over the same mods, and SDPA (flash and cuDNN where they
express the variant; the memory-efficient kernel with a dense boolean mask where only a mask does).

Grouped-query attention: ``--heads 32:8`` gives 32 query heads on 8 key/value heads (``enable_gqa``
for every implementation, SDPA's included); several shapes and ``--seq-len`` several lengths make one
row each. The batch still makes Q 128 MiB (at least 1): at d = 128, 32:8 takes B = 2 at 8k and B = 1
at 32k, 8:1 takes B = 8 and B = 2, so both shapes do the same work at one length. GQA rows skip the
dense-mask SDPA: that kernel repeats K and V per query head over an L x S mask, no baseline for
grouped heads.

Method. q, k, v are leaves that require grad, so every forward is a training forward (it builds the
autograd graph and, for flexattn, keeps the LSE). Each implementation runs one forward, ``out``, and
its first backward (the first-call times include Triton compilation, autotuning, and for torch's
flex_attention the torch.compile of the forward and the backward graphs). Then:

* forward: ``fn()`` is timed;
* backward: ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` is timed on the one
  graph, so the backward is measured alone, with no forward to subtract;
* fwd+bwd is the sum of the two medians.

Times are medians of CUDA-event timings (triton.testing.do_bench, L2 flushed between calls), with a
budget of ``--rep`` ms but at least five timed calls. FLOPs: forward 4 * B * H * L * S * D * density,
backward 2.5x that, fwd+bwd 3.5x, with density the fraction of (query, key) blocks flexattn's
BlockMask computes, the same count for every implementation (a dense SDPA kernel does more work than
it is credited with). Speed-ups are other_ms / flexattn_ms, so above 1 means flexattn is faster.

Correctness, on every case, because a fast wrong kernel is worse than none: flexattn's output and
its gradients dq, dk, dv against torch's compiled flex_attention on the same inputs (norm-wise
relative error per tensor; the maximum over the three is flagged above ``--grad-tol``), and both
against a float32 dense oracle (``flexattn.reference``) on one batch's last key/value head and its
query heads (one head without GQA), where flexattn's error must stay within twice torch's (or
``--oracle-floor``): the flash-attention rule. Mismatches are
printed loudly, recorded in the row's ``grad_check``, and make the exit status 1. Errors of any one
implementation (cuDNN refusing a shape, running out of memory) are recorded in the row, never fatal.

``--smoke`` runs tiny sizes anywhere: on a CPU machine under TRITON_INTERPRET=1 flexattn runs its
Triton kernels in the interpreter; torch's flex_attention has no CPU backward, so flexattn's blockwise
PyTorch backend stands in for it in the torch columns (the JSON's env says so), and SDPA's CUDA-only
backends record their errors. The timings then mean nothing; the run checks the code paths.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from typing import Callable, Optional

import torch

import flexattn
from flexattn.bench.common import block_density, compile_torch_flex, dense_mask_sdpa, git_commit, sdpa_fn
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE

PAPER_VARIANTS = [name for name, variant in CATALOGUE.items() if variant.paper]

# Q bytes per case (K and V too without GQA): B = 4 at d = 64, B = 2 at d = 128, 16 heads, 16k
TRAIN_Q_BYTES = 128 * 2**20
BWD_FLOP_FACTOR = 2.5  # backward FLOPs per forward FLOP: five matmuls against the forward's two
GRADS = ("dq", "dk", "dv")
SDPA_BACKENDS = ("flash", "cudnn")
SMOKE = {"seq_len": 256, "heads": 2, "batch": 1, "head_dims": [32]}


def heads_shape(text: str) -> tuple[int, int]:
    """A ``--heads`` value: ``"16"`` (as many key/value heads as query heads) or ``"32:8"`` (GQA, query
    heads : key/value heads) -> (query heads, key/value heads)."""
    query, colon, kv = text.partition(":")
    try:
        shape = int(query), int(kv if colon else query)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give H or HQ:HKV, e.g. 16 or 32:8") from None
    if min(shape) < 1 or shape[0] % shape[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: the query heads must be a multiple of the key/value heads")
    return shape


def shape_label(row: dict) -> str:
    """A row's batch, heads and length: ``"B2 H16 16k"``, with GQA ``"B2 H32:8 8k"``."""
    heads = f"{row['H']}:{row['H_kv']}" if row.get("H_kv", row["H"]) != row["H"] else f"{row['H']}"
    length = f"{row['L'] // 1024}k" if row["L"] % 1024 == 0 else f"{row['L']}"
    return f"B{row['B']} H{heads} {length}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timer(device: torch.device, rep_ms: float, min_reps: int) -> Callable[[Callable], float]:
    """Median milliseconds of ``fn``: do_bench on CUDA (at least ``min_reps`` timed calls), wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        def bench(fn):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            estimate_ms = (time.perf_counter() - start) * 1e3
            # do_bench repeats rep / (its own estimate) times: one estimate to spare keeps min_reps
            return triton.testing.do_bench(
                fn, warmup=25, rep=max(rep_ms, (min_reps + 1) * estimate_ms), return_mode="median"
            )

        return bench

    def bench(fn):  # CPU smoke runs: the numbers only show that the path runs
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]

    return bench


def _backward_launches() -> dict:
    """The launch counters of flexattn's backward kernel families, by path: "GLUON" (the Hopper
    kernels, flexattn.kernels.hopper.backward) and "TRITON" (the portable ones)."""
    counts = {}
    for path, module_name in (("GLUON", "flexattn.kernels.hopper.backward"), ("TRITON", "flexattn.kernels.backward")):
        try:
            module = __import__(module_name, fromlist=["launches"])
        except ImportError:
            continue
        count = getattr(module, "launches", None)
        if isinstance(count, int):
            counts[path] = count
    return counts


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error in float32 (as tests/numerics.py, without its non-finite handling:
    attention outputs and gradients are finite)."""
    diff = (actual.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-30)).item()


def _measure(impl: str, fn: Callable, q, k, v, dout, row: dict, bench, device, *, time_backward=True):
    """Time ``fn``'s forward and backward into ``row``; return (out, grads) detached, or None on error."""
    try:
        start = time.perf_counter()
        out = fn()
        _sync(device)
        row[f"{impl}_first_fwd_s"] = round(time.perf_counter() - start, 3)
        ours = impl.startswith("flexattn")
        before = _backward_launches() if ours else {}
        start = time.perf_counter()
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        _sync(device)
        row[f"{impl}_first_bwd_s"] = round(time.perf_counter() - start, 3)
        if ours:
            after = _backward_launches()
            ran = [path for path in after if after[path] > before.get(path, after[path])]
            row[f"{impl}_bwd_backend"] = ran[0] if ran else "PYTORCH"
            if not ran and device.type == "cuda":
                time_backward = False
                row[f"{impl}_bwd_error"] = (
                    "the backward ran on the blockwise PyTorch path (no kernel family's launch counter moved); not timed"
                )
                print(f"!!! {impl} {row['variant']} d={row['D']} {shape_label(row)}: {row[f'{impl}_bwd_error']}",
                      flush=True)
        row[f"{impl}_fwd_ms"] = bench(fn)
        if time_backward:
            row[f"{impl}_bwd_ms"] = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
            row[f"{impl}_fwdbwd_ms"] = row[f"{impl}_fwd_ms"] + row[f"{impl}_bwd_ms"]
    except Exception as err:  # one implementation failing (cuDNN refusing a shape, OOM) must not end the run
        row[f"{impl}_error"] = _first_line(err)
        print(f"  {impl} {row['variant']} d={row['D']} {shape_label(row)}: {row[f'{impl}_error']}", flush=True)
        return None
    return out.detach(), [g.detach() for g in grads]


def _shifted(mod: Optional[Callable], b0: int, h0: int, with_score: bool) -> Optional[Callable]:
    """``mod`` seen from the one-(batch, head) slice ``[b0, h0]``: its b and h arguments are offset back."""
    if mod is None:
        return None
    if with_score:
        return lambda score, b, h, q_idx, kv_idx: mod(score, b + b0, h + h0, q_idx, kv_idx)
    return lambda b, h, q_idx, kv_idx: mod(b + b0, h + h0, q_idx, kv_idx)


def oracle_errors(q, k, v, dout, score_mod, mask_mod, results: dict, b0: int, kv_head: int) -> dict:
    """float32 dense reference on batch b0's key/value head ``kv_head`` and the query heads that read
    it (exact copies of the bf16 inputs): each implementation's relative error of out, dq, dk, dv there.
    That group's gradients depend on the group alone, so the slice is an exact sub-problem. Its query
    heads run one at a time, their dK and dV summed, so the oracle holds one head's L x S scores (4 GiB
    at 32k tokens), GQA or not."""
    group = q.shape[1] // k.shape[1]
    heads = slice(kv_head * group, (kv_head + 1) * group)
    k32, v32 = (t[b0 : b0 + 1, kv_head : kv_head + 1].detach().float() for t in (k, v))
    outs, dqs, dk, dv = [], [], torch.zeros_like(k32), torch.zeros_like(v32)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the oracle, whatever the process set
    try:
        for h in range(heads.start, heads.stop):
            leaves = [q[b0 : b0 + 1, h : h + 1].detach().float().requires_grad_(),
                      k32.detach().requires_grad_(), v32.detach().requires_grad_()]
            out, _, _ = reference_attention(*leaves, _shifted(score_mod, b0, h, True), _shifted(mask_mod, b0, h, False))
            dq_h, dk_h, dv_h = torch.autograd.grad(out, leaves, dout[b0 : b0 + 1, h : h + 1].float())
            outs.append(out.detach())
            dqs.append(dq_h)
            dk += dk_h
            dv += dv_h
            del out, dq_h, dk_h, dv_h, leaves
    finally:
        torch.set_float32_matmul_precision(precision)
    expected = {"out": torch.cat(outs, dim=1), "dq": torch.cat(dqs, dim=1), "dk": dk, "dv": dv}
    del outs, dqs
    sliced = {"out": heads, "dq": heads, "dk": slice(kv_head, kv_head + 1), "dv": slice(kv_head, kv_head + 1)}
    errors = {}
    for impl, (impl_out, impl_grads) in results.items():
        got = {"out": impl_out, **dict(zip(GRADS, impl_grads))}
        errors[impl] = {name: _rel_err(got[name][b0 : b0 + 1, sliced[name]], expected[name]) for name in expected}
    return errors


def _check(row: dict, args) -> list[str]:
    """The row's correctness verdicts: an empty list when flexattn agrees with torch and the oracle."""
    problems = []
    vs_torch = row.get("grad_max_rel_err_vs_torch_flex")
    if vs_torch is not None and not vs_torch <= args.grad_tol:  # `not <=` also catches NaN
        problems.append(f"gradients differ from torch's compiled flex_attention: max rel err {vs_torch:.2e} > {args.grad_tol:.0e}")
    oracle = row.get("rel_err_vs_oracle", {})
    ours = oracle.get("flexattn")
    for name in ("out",) + GRADS:
        if ours is None:
            break
        limit = max(2 * oracle.get("torch_flex", {}).get(name, 0.0), args.oracle_floor)
        if not ours[name] <= limit:
            problems.append(f"{name} vs the float32 oracle: rel err {ours[name]:.2e} > {limit:.2e} (2x torch's, floor {args.oracle_floor:.0e})")
    if "flexattn_error" in row:
        problems.append(f"flexattn failed: {row['flexattn_error']}")
    return problems


def _tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    return round(flops / (ms * 1e-3) / 1e12, 1) if ms else None


def _ratio(other_ms: Optional[float], ours_ms: Optional[float]) -> Optional[float]:
    return round(other_ms / ours_ms, 3) if other_ms and ours_ms else None


def _run_case(name: str, B: int, H: int, H_kv: int, L: int, D: int, dtype, device, options, torch_flex, bench,
              args) -> dict:
    S = L
    gqa = H_kv != H
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, heads, n, D, device=device, dtype=dtype, requires_grad=True)
               for heads, n in ((H, L), (H_kv, S), (H_kv, S)))
    dout = torch.randn(B, H, L, D, device=device, dtype=dtype)
    score_mod, mask_mod = CATALOGUE[name].build(B, H, L, S, device)
    bm = flexattn.create_block_mask(mask_mod, None, None, L, S, device=device) if mask_mod else None
    density = block_density(bm) if bm is not None else 1.0
    fwd_flops = 4.0 * B * H * L * S * D * density
    flops = {"fwd": fwd_flops, "bwd": BWD_FLOP_FACTOR * fwd_flops, "fwdbwd": (1 + BWD_FLOP_FACTOR) * fwd_flops}
    row = {"variant": name, "B": B, "H": H, "H_kv": H_kv, "L": L, "S": S, "D": D,
           "dtype": str(dtype).replace("torch.", ""),
           "density": round(density, 4), **{f"{p}_flops": f for p, f in flops.items()}}

    results = {}
    ours = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,  # noqa: E731
                                           kernel_options=options)
    results["flexattn"] = _measure("flexattn", ours, q, k, v, dout, row, bench, device)
    if args.portable:  # flexattn pinned to its portable Triton kernels, forward and backward
        portable = {**options, "BACKEND": "TRITON"}
        pinned = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,  # noqa: E731
                                                 enable_gqa=gqa, kernel_options=portable)
        results["flexattn_portable"] = _measure("flexattn_portable", pinned, q, k, v, dout, row, bench, device)
    if args.two_pass:  # the deterministic backward (on Hopper: dQ added in a fixed order, or its own kernel)
        two_pass = {**options, "DETERMINISTIC": True}
        pinned = lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,  # noqa: E731
                                                 enable_gqa=gqa, kernel_options=two_pass)
        results["flexattn_two_pass"] = _measure("flexattn_two_pass", pinned, q, k, v, dout, row, bench, device)
    if torch_flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

        tbm = torch_create_block_mask(mask_mod, None, None, L, S, device=device) if mask_mod else None
        theirs = lambda: torch_flex(q, k, v, score_mod=score_mod, block_mask=tbm, enable_gqa=gqa)  # noqa: E731
        results["torch_flex"] = _measure("torch_flex", theirs, q, k, v, dout, row, bench, device)
        if args.torch_flash:  # torch's FlashAttention-4 (CuTe DSL) kernels from the same mods
            flash = lambda: torch_flex(q, k, v, score_mod=score_mod, block_mask=tbm, enable_gqa=gqa,  # noqa: E731
                                       kernel_options={"BACKEND": "FLASH"})
            results["torch_flash"] = _measure("torch_flash", flash, q, k, v, dout, row, bench, device)
    for backend in SDPA_BACKENDS:
        fn = sdpa_fn(name, q, k, v, backend)
        if fn is not None:
            _measure(f"sdpa_{backend}", fn, q, k, v, dout, row, bench, device)
    if score_mod is None and mask_mod is not None and name != "causal" and not gqa:
        try:
            fn = dense_mask_sdpa(q, k, v, mask_mod, device)
        except Exception as err:
            row["sdpa_efficient_dense_error"] = _first_line(err)
        else:
            _measure("sdpa_efficient_dense", fn, q, k, v, dout, row, bench, device)
            del fn

    if results.get("flexattn") and results.get("torch_flex"):
        (out_f, grads_f), (out_t, grads_t) = results["flexattn"], results["torch_flex"]
        row["out_rel_err_vs_torch_flex"] = _rel_err(out_f, out_t)
        row["grad_rel_err_vs_torch_flex"] = {g: _rel_err(a, b) for g, a, b in zip(GRADS, grads_f, grads_t)}
        row["grad_max_rel_err_vs_torch_flex"] = max(row["grad_rel_err_vs_torch_flex"].values())
    kept = {impl: r for impl, r in results.items() if r is not None}
    if args.oracle and kept:
        b0, kv_head = B - 1, H_kv - 1  # the last slice: mods see nonzero b and h
        row["oracle_slice"] = [b0, kv_head]  # the batch and the key/value head (with its query heads)
        try:
            row["rel_err_vs_oracle"] = oracle_errors(q, k, v, dout, score_mod, mask_mod, kept, b0, kv_head)
        except Exception as err:
            row["oracle_error"] = _first_line(err)

    for key in [key for key in row if key.endswith("_ms") and row[key]]:
        row[key.replace("_ms", "_tflops")] = _tflops(flops[key.rsplit("_", 2)[-2]], row[key])
    for phase in ("fwd", "bwd", "fwdbwd"):
        ours_ms = row.get(f"flexattn_{phase}_ms")
        row[f"{phase}_speedup_vs_torch_flex"] = _ratio(row.get(f"torch_flex_{phase}_ms"), ours_ms)
        row[f"{phase}_ratio_vs_cudnn"] = _ratio(row.get(f"sdpa_cudnn_{phase}_ms"), ours_ms)
        if f"torch_flash_{phase}_ms" in row:
            row[f"{phase}_ratio_vs_torch_flash"] = _ratio(row.get(f"torch_flash_{phase}_ms"), ours_ms)
        if f"flexattn_portable_{phase}_ms" in row:
            row[f"{phase}_ratio_vs_portable"] = _ratio(row.get(f"flexattn_portable_{phase}_ms"), ours_ms)
        if f"flexattn_two_pass_{phase}_ms" in row:
            row[f"{phase}_ratio_vs_two_pass"] = _ratio(row.get(f"flexattn_two_pass_{phase}_ms"), ours_ms)
    problems = _check(row, args)
    row["grad_check"] = "ok" if not problems else problems
    for problem in problems:
        print(f"!!! MISMATCH {name} d={D} {shape_label(row)}: {problem}", flush=True)
    return row


def _markdown(rows: list[dict]) -> str:
    def ms(x):
        return f"{x:.2f}" if x else "-"

    def tf(x):
        return f"{x:.0f}" if x else "-"

    def ratio(x):
        return f"{x:.2f}x" if x else "-"

    lines = [
        "| variant | d | shape | density | flexattn fwd / bwd ms | bwd TFLOP/s | fwd+bwd TFLOP/s "
        "| torch flex (compiled) fwd / bwd ms | bwd TFLOP/s | bwd speed-up | fwd+bwd speed-up "
        "| SDPA cuDNN bwd ms | flexattn / cuDNN bwd | fwd+bwd | SDPA flash bwd ms | max grad rel err vs torch | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    flash = any(f"{impl}_bwd_ms" in r for r in rows for impl in ("torch_flash", "flexattn_portable", "flexattn_two_pass"))
    for r in rows:
        err = r.get("grad_max_rel_err_vs_torch_flex")
        lines.append(
            f"| {r['variant']} | {r['D']} | {shape_label(r)} | {r['density']:.2f} "
            f"| {ms(r.get('flexattn_fwd_ms'))} / {ms(r.get('flexattn_bwd_ms'))} | {tf(r.get('flexattn_bwd_tflops'))} "
            f"| {tf(r.get('flexattn_fwdbwd_tflops'))} "
            f"| {ms(r.get('torch_flex_fwd_ms'))} / {ms(r.get('torch_flex_bwd_ms'))} | {tf(r.get('torch_flex_bwd_tflops'))} "
            f"| {ratio(r.get('bwd_speedup_vs_torch_flex'))} | {ratio(r.get('fwdbwd_speedup_vs_torch_flex'))} "
            f"| {ms(r.get('sdpa_cudnn_bwd_ms'))} | {ratio(r.get('bwd_ratio_vs_cudnn'))} | {ratio(r.get('fwdbwd_ratio_vs_cudnn'))} "
            f"| {ms(r.get('sdpa_flash_bwd_ms'))} | {f'{err:.1e}' if err is not None else '-'} "
            f"| {'ok' if r['grad_check'] == 'ok' else 'MISMATCH'} |"
        )
    if flash:  # --portable / --two-pass / --torch-flash: the backward's paths side by side
        lines += [
            "",
            "| variant | d | shape | flexattn bwd (path) TFLOP/s | two-pass bwd TFLOP/s | portable bwd TFLOP/s "
            "| torch FLASH bwd TFLOP/s | x two-pass | x portable | x torch FLASH | x cuDNN | fwd x torch FLASH |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['variant']} | {r['D']} | {shape_label(r)} "
                f"| {tf(r.get('flexattn_bwd_tflops'))} ({r.get('flexattn_bwd_backend', '-')}) "
                f"| {tf(r.get('flexattn_two_pass_bwd_tflops'))} | {tf(r.get('flexattn_portable_bwd_tflops'))} "
                f"| {tf(r.get('torch_flash_bwd_tflops'))} | {ratio(r.get('bwd_ratio_vs_two_pass'))} "
                f"| {ratio(r.get('bwd_ratio_vs_portable'))} | {ratio(r.get('bwd_ratio_vs_torch_flash'))} "
                f"| {ratio(r.get('bwd_ratio_vs_cudnn'))} | {ratio(r.get('fwd_ratio_vs_torch_flash'))} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="default 64 128")
    parser.add_argument("--variants", nargs="+", default=PAPER_VARIANTS, choices=list(CATALOGUE), metavar="VARIANT",
                        help="default: the paper's seven (" + " ".join(PAPER_VARIANTS) + ")")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None, help="default 16384; several make a row each")
    parser.add_argument("--heads", type=heads_shape, nargs="+", default=None, metavar="H|HQ:HKV",
                        help="default 16; HQ:HKV is grouped-query attention (32:8: 32 query heads on 8 key/value "
                             "heads); several make a row each")
    parser.add_argument("--no-torch-flex", action="store_true", help="skip torch.compile(flex_attention)")
    parser.add_argument("--out", default=None, help="write all numbers as JSON here")
    parser.add_argument("--kernel-options", default="{}", help="JSON FlexKernelOptions for flexattn")
    parser.add_argument("--batch", type=int, default=None,
                        help="default: Q 128 MiB (at least 1; B4 at d=64 and B2 at d=128 with 16 heads at 16k)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--rep", type=float, default=100, help="do_bench budget per timing, ms (default 100)")
    parser.add_argument("--min-reps", type=int, default=5, help="at least this many timed calls (default 5)")
    parser.add_argument("--grad-tol", type=float, default=2e-2,
                          help="flag gradients whose relative error against torch's exceeds this (default 2e-2)")
    parser.add_argument("--oracle-floor", type=float, default=5e-3,
                          help="flexattn's error against the float32 oracle may reach max(2x torch's, this)")
    parser.add_argument("--no-oracle", dest="oracle", action="store_false",
                          help="skip the float32 oracle on one (batch, head) slice")
    parser.add_argument("--portable", action="store_true",
                        help="also time flexattn pinned to its portable Triton kernels (BACKEND TRITON)")
    parser.add_argument("--two-pass", action="store_true",
                        help="also time flexattn with DETERMINISTIC (the deterministic backward; its JSON keys say two_pass)")
    parser.add_argument("--torch-flash", action="store_true",
                        help="also time torch's flex_attention with BACKEND FLASH (FlashAttention-4 wheels needed)")
    parser.add_argument("--smoke", action="store_true",
                          help="tiny sizes (256 tokens, B1 H2 d32 unless given) that run on CPU under TRITON_INTERPRET=1")
    return run(parser.parse_args(argv))


def run(args) -> int:
    """The training benchmark for the parsed arguments of ``main``."""
    import triton

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("the training benchmark needs a CUDA GPU (or --smoke, for tiny sizes anywhere)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    seq_lens = args.seq_len or [SMOKE["seq_len"] if args.smoke else 16384]
    head_shapes = args.heads or [(SMOKE["heads"],) * 2 if args.smoke else (16, 16)]
    batch = args.batch or (SMOKE["batch"] if args.smoke else None)
    head_dims = args.head_dims or (SMOKE["head_dims"] if args.smoke else [64, 128])
    options = json.loads(args.kernel_options)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not cuda and interpreted and not options:
        options = {"BACKEND": "TRITON"}  # CPU tensors otherwise take the PyTorch backend

    torch_flex, torch_flex_how = None, "skipped (--no-torch-flex)"
    if not args.no_torch_flex:
        if cuda:
            torch_flex, torch_flex_how = compile_torch_flex(), "torch.compile(flex_attention, dynamic=False)"
        else:
            # torch's flex_attention has no CPU backward (eager or compiled); a smoke run checks the
            # comparison code against flexattn's blockwise PyTorch backend instead, and says so.
            def torch_flex(q, k, v, score_mod=None, block_mask=None, enable_gqa=False):
                return flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                               enable_gqa=enable_gqa, kernel_options={"BACKEND": "PYTORCH"})

            torch_flex_how = "STAND-IN (no CUDA): flexattn BACKEND=PYTORCH with torch's BlockMask"

    env = {
        "mode": "bwd",
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(),
        "flexattn_commit": git_commit(),
        "triton_interpret": interpreted,
        "dtype": args.dtype,
        "flexattn_kernel_options": options,
        "torch_flex": torch_flex_how,
        "rep_ms": args.rep,
        "min_reps": args.min_reps,
        "timing": "median ms; backward = autograd.grad(out, (q, k, v), dout, retain_graph=True) on one graph; fwdbwd = fwd + bwd",
        "flops": "fwd 4*B*H*L*S*D*density, bwd 2.5x fwd, fwdbwd 3.5x fwd",
        "grad_tol": args.grad_tol,
        "oracle_floor": args.oracle_floor,
    }
    print(json.dumps(env), flush=True)
    bench = _timer(device, args.rep, args.min_reps)
    rows = []
    started = time.perf_counter()

    def write():
        if args.out:  # written as we go: a crash later keeps the rows measured so far
            with open(args.out, "w") as f:
                json.dump({"env": {**env, "wall_s": round(time.perf_counter() - started, 1)}, "rows": rows}, f, indent=1)

    cases = [(D, H, H_kv, L, name) for D in head_dims for H, H_kv in head_shapes for L in seq_lens
             for name in args.variants]
    for D, H, H_kv, L, name in cases:
        B = batch or max(1, TRAIN_Q_BYTES // (H * L * D * 2))
        print(f"[{len(rows) + 1}/{len(cases)}] {name} d={D} B={B} H={H}{f':{H_kv}' if H_kv != H else ''} L={L} "
              f"({time.perf_counter() - started:.0f} s so far)", flush=True)
        row = _run_case(name, B, H, H_kv, L, D, dtype, device, options, torch_flex, bench, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write()
        gc.collect()  # the case's tensors, graphs and gradients went with _run_case's frame
        if cuda:
            torch.cuda.empty_cache()

    print()
    print(_markdown(rows))
    print()
    mismatched = [f"{r['variant']} d={r['D']} {shape_label(r)}" for r in rows if r["grad_check"] != "ok"]
    print(f"wall time {time.perf_counter() - started:.0f} s; torch.compile first calls (fwd + bwd) "
          f"{sum(r.get('torch_flex_first_fwd_s', 0) + r.get('torch_flex_first_bwd_s', 0) for r in rows):.0f} s")
    if mismatched:
        print(f"!!! GRADIENT CHECK FAILED on {len(mismatched)} of {len(rows)} cases: {', '.join(mismatched)}")
    else:
        print(f"gradient checks: all {len(rows)} cases agree")
    write()
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
