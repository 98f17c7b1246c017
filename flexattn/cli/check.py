"""``flexattn check``: every catalogue variant through flexattn on the local device, checked and timed.

    flexattn check [--device cuda|cpu] [--seq N] [--only NAME[,NAME]] [--out PATH]
    python -m flexattn check ...                    # the same

For each variant (``flexattn.variants.CATALOGUE``): build it (:meth:`Variant.make`), its BlockMask,
run ``flex_attention`` forward and backward on random inputs, and compare the output and the
gradients (of q, k, v and of every learnable tensor the variant captures) with the float64
reference built from the same mods. Then time a warm forward and a warm backward; on a GPU, also
SDPA's flash kernel and torch's compiled flex_attention at the same sizes.

This module measures and returns plain rows (dicts); ``flexattn.cli`` draws the progress bar and
the table and writes the files, so this stage needs nothing beyond torch.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import flexattn
from flexattn.variants import CATALOGUE, Variant

__all__ = ["CheckSizes", "default_sizes", "run_variant", "run_check", "TOLERANCE", "environment"]

# Norm-wise relative error allowed against the float64 reference, by input dtype (the tests' rule:
# fp32 ~1e-5; 16-bit inputs ~1e-2). Gradients of learnable tensors sum over every (query, key) pair,
# so fp32 gets a little room above the forward's 1e-5.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class CheckSizes:
    B: int
    H: int
    L: int
    D: int
    dtype: torch.dtype


def default_sizes(device: str, seq: Optional[int] = None) -> CheckSizes:
    """What the job runs at. On a CPU: small enough that the whole catalogue (forward, backward,
    the float64 reference and the timings) finishes in well under a minute on 2 cores with one
    thread. On a GPU: large enough that kernel time, not launch overhead, is what is timed, while
    the float64 reference (B * H * L * L doubles, a few times over for its gradients) still fits."""
    if device == "cuda":
        return CheckSizes(B=1, H=16, L=seq or 4096, D=64, dtype=torch.bfloat16)
    return CheckSizes(B=1, H=2, L=seq or 1024, D=64, dtype=torch.float32)


def environment(device: str) -> dict:
    env = {
        "flexattn": flexattn.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "CPU"),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _rel_err(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> float:
    """Norm-wise relative error; a missing gradient where the reference has one is an infinite error."""
    if actual is None or expected is None:
        return 0.0 if actual is None and expected is None else math.inf
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(actual)):
        return math.inf  # NaN or inf in other places than the reference's: as wrong as it gets
    diff = (actual.double() - expected.double())[finite]
    return (diff.norm() / expected.double()[finite].norm().clamp_min(1e-30)).item()


def _timer(device: str, repeats: int) -> Callable[[Callable], float]:
    """Median milliseconds of a warm call: CUDA-event timings on a GPU, wall clock on a CPU."""
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    def wall(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return wall


def _grad_inputs(q, k, v, inst) -> list:
    extra = [t for t in inst.learnable if isinstance(t, torch.Tensor) and t.requires_grad]
    if inst.sinks is not None and inst.sinks.requires_grad and not any(t is inst.sinks for t in extra):
        extra.append(inst.sinks)
    return [q, k, v, *extra]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def _fold_sinks(out, lse, sinks):
    # The same fold as Instance.attend: a sink is one more logit with a zero value vector.
    return (out * torch.sigmoid(lse - sinks.view(1, -1, 1).to(lse.dtype)).unsqueeze(-1).to(out.dtype)).to(out.dtype)


def _sdpa_baseline(inst, bm, q, k, v):
    """SDPA's flash kernel: the same computation where SDPA can express it (no score_mod, no sinks,
    and no mask or exactly the causal one), else full attention at the same sizes (the dense cost)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    same = inst.score_mod is None and inst.sinks is None
    causal = False
    if same and inst.mask_mod is not None:
        L, S = q.shape[2], k.shape[2]
        dense = flexattn.create_mask(inst.mask_mod, q.shape[0], q.shape[1], L, S, device=q.device)
        causal = L == S and bool((dense == torch.ones(L, S, dtype=torch.bool, device=q.device).tril()).all())
        same = causal

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run, ("same" if same else "dense")


def _torch_flex(inst, q, compiled):
    """torch's compiled flex_attention running the same instance (raises where torch cannot)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    tbm = torch_create_block_mask(inst.mask_mod, B, H, L, L, device=q.device) if inst.mask_mod else None

    def run(q, k, v):
        if inst.sinks is None:
            return compiled(q, k, v, score_mod=inst.score_mod, block_mask=tbm)
        out, lse = compiled(q, k, v, score_mod=inst.score_mod, block_mask=tbm, return_lse=True)
        return _fold_sinks(out, lse, inst.sinks)

    return run


@dataclass
class _Timed:
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    error: Optional[str] = None


def _time_impl(attend: Callable, q, k, v, inst, dout, timer) -> _Timed:
    """Forward and backward time of ``attend(q, k, v)``: the backward is autograd.grad on one
    retained graph, so it times the backward kernels alone."""
    result = _Timed()
    inputs = _grad_inputs(q, k, v, inst)
    try:
        with torch.no_grad():
            result.fwd_ms = timer(lambda: attend(q, k, v))
        out = attend(q, k, v)
        # allow_unused: a baseline that does not read a variant's learnable tensors (SDPA) times its own backward
        result.bwd_ms = timer(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True, allow_unused=True))
    except Exception as err:  # a baseline that cannot run this variant: said in the row, not fatal
        result.error = _first_line(err)
    return result


def run_variant(name: str, variant: Variant, sizes: CheckSizes, device: str, *, repeats: int = 5,
                torch_flex: Optional[Callable] = None, seed: int = 0) -> dict:
    """One row: errors against the float64 reference and times (see the module docstring)."""
    B, H, L, D, dtype = sizes.B, sizes.H, sizes.L, sizes.D, sizes.dtype
    row: dict = {"variant": name, "summary": variant.summary, "B": B, "H": H, "L": L, "D": D,
                 "dtype": str(dtype).replace("torch.", ""), "tolerance": TOLERANCE[dtype]}
    try:
        torch.manual_seed(seed)
        inst = variant.make(B, H, L, L, device)
        bm = inst.block_mask(B, H, L, L, device)
        row["sparsity"] = round(bm.sparsity(), 2) if bm is not None else 0.0
        q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, L, D, device=device, dtype=dtype)
        inputs = _grad_inputs(q, k, v, inst)

        from flexattn.kernels import backward as triton_backward
        from flexattn.kernels.hopper import backward as hopper_backward

        def backward_launches() -> int:  # the portable Triton backward and the Hopper one (AUTO's choice there)
            return triton_backward.launches + hopper_backward.launches

        launches = backward_launches()
        out = inst.attend(q, k, v, block_mask=bm)
        grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
        row["backend"] = "triton" if q.is_cuda else "pytorch"  # AUTO's choice (flexattn.api._pick_backend)
        row["backend_bwd"] = "triton" if backward_launches() > launches else "pytorch"

        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = inst.reference(q64, k64, v64)
        ref_grads = torch.autograd.grad(ref, [q64, k64, v64, *inputs[3:]], dout.double(), allow_unused=True)
        row["fwd_err"] = _rel_err(out.detach(), ref.detach())
        names = ["dq", "dk", "dv"] + [f"d{getattr(t, 'name', None) or 'learnable' + str(i)}"
                                      for i, t in enumerate(inputs[3:])]
        grad_errs = {n: _rel_err(g, r) for n, g, r in zip(names, grads, ref_grads)}
        row["grad_errs"] = grad_errs
        row["grad_err"] = max(grad_errs.values())
        row["learnable"] = len(inputs) - 3
        del ref, ref_grads, q64, k64, v64, grads

        timer = _timer(device, repeats)
        ours = _time_impl(lambda q, k, v: inst.attend(q, k, v, block_mask=bm), q, k, v, inst, dout, timer)
        if ours.error:
            raise RuntimeError(ours.error)
        row["fwd_ms"], row["bwd_ms"] = ours.fwd_ms, ours.bwd_ms
        if device == "cuda":
            sdpa, kind = _sdpa_baseline(inst, bm, q, k, v)
            base = _time_impl(sdpa, q, k, v, inst, dout, timer)
            row["sdpa"] = {"kind": kind, "fwd_ms": base.fwd_ms, "bwd_ms": base.bwd_ms, "error": base.error}
            if torch_flex is not None:
                try:
                    theirs = _time_impl(_torch_flex(inst, q, torch_flex), q, k, v, inst, dout, timer)
                except Exception as err:  # torch's create_block_mask itself
                    theirs = _Timed(error=_first_line(err))
                row["torch_flex"] = {"fwd_ms": theirs.fwd_ms, "bwd_ms": theirs.bwd_ms, "error": theirs.error}
        row["ok"] = row["fwd_err"] <= TOLERANCE[dtype] and row["grad_err"] <= TOLERANCE[dtype]
    except Exception as err:
        row["error"] = _first_line(err)
        row["ok"] = False
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def compile_torch_flex() -> Optional[Callable]:
    """torch's flex_attention under torch.compile, or None where this torch has none."""
    try:
        from flexattn.bench.common import compile_torch_flex as compile_it

        return compile_it()
    except Exception:
        return None


def run_check(names: list[str], device: str, sizes: CheckSizes, *, on_start: Callable[[str], None] = lambda name: None,
            on_done: Callable[[dict], None] = lambda row: None, torch_flex: bool = True) -> dict:
    """Every named variant in order; returns ``{"env": ..., "sizes": ..., "rows": [...]}``."""
    compiled = compile_torch_flex() if device == "cuda" and torch_flex else None
    rows = []
    for name in names:
        on_start(name)
        row = run_variant(name, CATALOGUE[name], sizes, device, torch_flex=compiled)
        rows.append(row)
        on_done(row)
    return {
        "env": environment(device),
        "sizes": {"B": sizes.B, "H": sizes.H, "L": sizes.L, "D": sizes.D, "dtype": str(sizes.dtype).replace("torch.", "")},
        "rows": rows,
    }
