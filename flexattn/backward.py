"""The Triton backward: compile-once kernels, launch plans and launches for dQ, dK, dV and the
gradients of captured tensors.

Stage 4 of the pipeline for training (trace -> lowering -> codegen -> runtime), beside the forward's
``runtime.py``, whose configuration, table and cache machinery it shares. Three kernels, rendered
together from ``templates/backward.py.jinja``:

1. preprocess: DELTA = rowsum(dO * O) - dLSE, one program per query tile;
2. dK/dV: one program per key tile of one key/value head, walking the query blocks that see it
   through the BlockMask's transposed tables, summing over the query heads of its GQA group;
3. dQ: one program per query tile, walking the same key blocks as the forward.

Every output row is written by exactly one program, so there are no atomics on dQ, dK or dV and
the result does not depend on scheduling. Gradients of captured tensors (a learnable bias) are
added with float32 atomics by the dK/dV kernel only, at the addresses the mod read.

The transposed tables are derived from the forward's checked tables (never taken from the mask's
own ``q_indices``, which a hand-built mask could let disagree with ``kv_indices``): the backward
walks exactly the blocks the forward walked.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from types import ModuleType
from typing import NamedTuple, Optional

import torch

from . import lowering
from .block_mask import BlockMask, _dense_to_ordered, _ordered_to_dense
from .codegen import KernelSpec
from .errors import InvalidInputError, ResourceError
from .index_bounds import index_bounds
from .launch import launch
from . import runtime
from .runtime import (
    KernelFamily, LaunchConfig, _empty, _fit_to_mask, _input_precision, _install_tma_allocator, _is_out_of_resources,
    _next_pow2, _tma_compatible, cached_kernel, interpreter_enabled, launch_tables, max_shared_memory,
    mod_launch_args, spilled_bytes, triton_cdiv, tuned_configs,
)
from .trace import TracedMod

__all__ = ["BackwardKernel", "backward_kernel", "BackwardConfig", "select_backward_config", "launches"]

launches = 0  # Triton backward calls in this process (tests check that the kernels, not a fallback, ran)


# ------------------------------------------------------------------------------------ configs


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two main kernels, with torch's names: the dK/dV kernel owns BLOCK_N1 keys and
    walks BLOCK_M1 queries at a time; the dQ kernel owns BLOCK_M2 queries and walks BLOCK_N2 keys."""

    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    num_warps: int  # both kernels, unless num_warps2 sets the dQ kernel's
    num_stages: int
    num_warps2: int = 0  # dQ kernel; 0: num_warps
    num_stages2: int = 0
    USE_TMA: bool = False  # stream the walked tiles through tensor descriptors (Hopper's copy engine)

    def dkdv(self) -> LaunchConfig:
        return LaunchConfig(self.BLOCK_M1, self.BLOCK_N1, self.num_warps, self.num_stages)

    def dq(self) -> LaunchConfig:
        return LaunchConfig(self.BLOCK_M2, self.BLOCK_N2, self.num_warps2 or self.num_warps,
                            self.num_stages2 or self.num_stages)


# (head dim up to, 16-bit inputs, has a mask_mod): defaults from per-kernel sweeps on an H100 at 16k
# tokens (bf16, B4 H16 d64 and B2 H16 d128; gym's sweep, docs/benchmarks.md). 64x64 tiles, 4 warps
# and two stages win for both kernels, at both head dims, with and without a mask: d64 dK/dV 18.4 ms
# against 19.3-23 for 32x128 and 64x128 (no mask), d128 14.2 against 17.7-25; a third stage costs
# 3% without a mask and 80% on the causal mask's partial blocks at d128 (register spills). The
# walked tiles go through tensor descriptors where the layout allows (USE_TMA; 1-6% faster).
_GPU_BACKWARD_DEFAULTS = {
    (64, True, False): BackwardConfig(64, 64, 64, 64, 4, 2, USE_TMA=True),
    (64, True, True): BackwardConfig(64, 64, 64, 64, 4, 2, USE_TMA=True),
    (128, True, False): BackwardConfig(64, 64, 64, 64, 4, 2, USE_TMA=True),
    # dQ on masks at d128: 128x128 programs with 8 warps, 2-5% faster than 64x64 (slower without a mask).
    (128, True, True): BackwardConfig(64, 64, 128, 128, 4, 2, num_warps2=8, USE_TMA=True),
    (256, True, False): BackwardConfig(32, 64, 64, 32, 8, 2),
    (256, True, True): BackwardConfig(32, 64, 64, 32, 8, 2),
    (64, False, False): BackwardConfig(32, 64, 64, 32, 4, 2),
    (64, False, True): BackwardConfig(32, 64, 64, 32, 4, 2),
    (128, False, False): BackwardConfig(32, 64, 64, 32, 8, 2),
    (128, False, True): BackwardConfig(32, 64, 64, 32, 8, 2),
    (256, False, False): BackwardConfig(16, 32, 32, 16, 8, 1),
    (256, False, True): BackwardConfig(16, 32, 32, 16, 8, 1),
}


def backward_shared_memory_bytes(cfg: BackwardConfig, elem: int, qk_p2: int, v_p2: int) -> int:
    """Upper estimate for the larger of the two kernels: the resident tiles (K and V, or Q and dO)
    once, the streamed ones per pipeline stage, and the transposed score tiles."""
    stages = max(1, cfg.num_stages - 1)
    dkdv = (cfg.BLOCK_N1 * (qk_p2 + v_p2) + cfg.BLOCK_M1 * (qk_p2 + v_p2) * stages) * elem
    dkdv += 2 * cfg.BLOCK_M1 * cfg.BLOCK_N1 * elem
    dq = (cfg.BLOCK_M2 * (qk_p2 + v_p2) + cfg.BLOCK_N2 * (qk_p2 + v_p2) * stages) * elem
    dq += cfg.BLOCK_M2 * cfg.BLOCK_N2 * elem
    return max(dkdv, dq)


def _fit_backward(cfg: BackwardConfig, sparse_q: int, sparse_kv: int) -> BackwardConfig:
    dkdv = _fit_to_mask(cfg.dkdv(), sparse_q, sparse_kv)
    dq = _fit_to_mask(cfg.dq(), sparse_q, sparse_kv)
    return replace(cfg, BLOCK_M1=dkdv.BLOCK_M, BLOCK_N1=dkdv.BLOCK_N, BLOCK_M2=dq.BLOCK_M, BLOCK_N2=dq.BLOCK_N)


# Masks whose rows visit few blocks (documents: about 5 of 128 at 16k tokens), where each program's
# set-up is a larger share (document mask, per-kernel sweep on the H100): d64 prefers 32-row steps
# under 64-key programs and 32-key steps (dK/dV 0.93 vs 1.10 ms, dQ 0.67 vs 0.72); d128 prefers
# pointer loads, whose programs skip the descriptors' set-up (0.74 vs 0.77 ms, 0.57 vs 0.61).
_GPU_BACKWARD_SHORT_ROWS = {
    64: BackwardConfig(32, 64, 64, 32, 4, 2, USE_TMA=True),
    128: BackwardConfig(64, 64, 64, 64, 4, 2),
}


def select_backward_config(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int,
                           sparse_q: int, sparse_kv: int, has_mask_mod: bool = False,
                           blocks_per_row: float = float("inf")) -> BackwardConfig:
    if interpreter_enabled() or device.type != "cuda":
        # The interpreter runs each program in numpy: fewer, larger tiles are faster.
        return _fit_backward(BackwardConfig(64, 64, 64, 64, 4, 1), sparse_q, sparse_kv)
    bucket = next((d for d in (64, 128, 256) if max(qk_dim, v_dim) <= d), 256)
    base = _GPU_BACKWARD_DEFAULTS[(bucket, dtype.itemsize <= 2, has_mask_mod)]
    if has_mask_mod and blocks_per_row < 8 and dtype.itemsize <= 2 and bucket in _GPU_BACKWARD_SHORT_ROWS:
        base = _GPU_BACKWARD_SHORT_ROWS[bucket]
    cfg = _fit_backward(base, sparse_q, sparse_kv)
    limit = max_shared_memory(device)
    qk_p2, v_p2 = _next_pow2(qk_dim), _next_pow2(v_dim)
    while backward_shared_memory_bytes(cfg, dtype.itemsize, qk_p2, v_p2) > limit:
        if cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif max(cfg.BLOCK_M1, cfg.BLOCK_N2) > 16:
            cfg = replace(cfg, BLOCK_M1=max(16, cfg.BLOCK_M1 // 2), BLOCK_N2=max(16, cfg.BLOCK_N2 // 2))
        elif max(cfg.BLOCK_N1, cfg.BLOCK_M2) > 16:
            cfg = replace(cfg, BLOCK_N1=max(16, cfg.BLOCK_N1 // 2), BLOCK_M2=max(16, cfg.BLOCK_M2 // 2))
        else:
            break
    return cfg


_BACKWARD_TILE_KEYS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")


def _pinned_backward_config(options: dict, default: BackwardConfig, sparse_q: int, sparse_kv: int) -> BackwardConfig:
    """``default`` with the tiles and launch sizes the caller pinned through kernel_options."""
    values = {k: options.get(k, getattr(default, k)) for k in _BACKWARD_TILE_KEYS}
    for key in ("num_warps", "num_stages"):
        # torch's rule: a bwd_ key sets the backward alone, a plain key sets both passes.
        value = options[f"bwd_{key}"] if f"bwd_{key}" in options else options.get(key)
        values[key] = getattr(default, key) if value is None else value
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"kernel_options['{key}'] must be an int, got {value!r}")
    blocks = {"BLOCK_M1": (sparse_q, "query"), "BLOCK_M2": (sparse_q, "query"),
              "BLOCK_N1": (sparse_kv, "key"), "BLOCK_N2": (sparse_kv, "key")}
    for key, (block, what) in blocks.items():
        value = values[key]
        if value < 16 or value & (value - 1) or block % value:
            raise InvalidInputError(
                f"kernel_options['{key}'] must be a power of two >= 16 that divides the BlockMask's {what} "
                f"block size {block}, got {value}"
            )
    if values["num_warps"] not in (1, 2, 4, 8, 16) or values["num_stages"] < 1:
        raise InvalidInputError(
            "kernel_options num_warps / bwd_num_warps must be 1, 2, 4, 8 or 16 and num_stages / bwd_num_stages "
            f">= 1, got {values['num_warps']} and {values['num_stages']}"
        )
    # A pinned launch size applies to both kernels; an unpinned one keeps the default's per-kernel values.
    for key in ("num_warps", "num_stages"):
        given = options[f"bwd_{key}"] if f"bwd_{key}" in options else options.get(key)
        if given is not None:
            values[f"{key}2"] = 0
    return replace(default, **values)


def _backward_pinned(options: dict) -> bool:
    return any(k in options for k in (*_BACKWARD_TILE_KEYS, "bwd_num_warps", "bwd_num_stages", "num_warps",
                                      "num_stages"))


# ------------------------------------------------------------------------------------ tables


class BackwardTables(NamedTuple):
    """The forward's tables transposed (per key block: the query blocks that see it), cropped to the
    blocks inside the lengths. Kept on the mask (BlockMask.derived), like the forward's."""

    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor  # q_num_blocks when the mask has no full blocks
    full_q_indices: torch.Tensor


def _compute_backward_tables(block_mask: BlockMask) -> BackwardTables:
    tables = launch_tables(block_mask)  # checked and ascending: exactly what the forward walked
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    rows, cols = -(-q_len // q_block), -(-kv_len // kv_block)

    def transposed(num, idx):
        dense = _ordered_to_dense(num, idx, cols)[:, :, :rows]
        return _dense_to_ordered(dense.transpose(-2, -1))

    qn, qi = transposed(tables.kv_num_blocks, tables.kv_indices)
    if tables.has_full:
        fqn, fqi = transposed(tables.full_kv_num_blocks, tables.full_kv_indices)
    else:
        fqn, fqi = qn, qi
    return BackwardTables(qn, qi, fqn, fqi)


def backward_tables(block_mask: BlockMask) -> BackwardTables:
    return block_mask.derived("backward_tables", _compute_backward_tables)


# ------------------------------------------------------------------------------------ kernels


@dataclass(frozen=True)
class CompiledBackward:
    spec: KernelSpec
    source: str
    source_digest: str
    module: ModuleType
    variants: tuple


class _BackwardPlan(NamedTuple):
    dkdv_grid: tuple[int, int, int]
    dq_grid: tuple[int, int, int]
    preprocess_block: int
    dkdv_constexprs: dict
    dq_constexprs: dict
    compiled: CompiledBackward
    check_compiled: bool = False  # default tiles not yet seen compiled: see [Note] Backward tiles the compiler made costly


_PLANS_PER_KERNEL = 256


def _with_tiles(plan: _BackwardPlan, dkdv: dict, dq: dict, L: int, S: int) -> _BackwardPlan:
    """``plan`` with these constexprs, its bounds flags and grids made to agree with their tiles."""
    dkdv["EVEN_N"] = S % dkdv["BLOCK_N"] == 0
    dq["EVEN_M"] = L % dq["BLOCK_M"] == 0
    dkdv_grid = (triton_cdiv(S, dkdv["BLOCK_N"]),) + tuple(plan.dkdv_grid[1:])
    dq_grid = (triton_cdiv(L, dq["BLOCK_M"]),) + tuple(plan.dq_grid[1:])
    return plan._replace(dkdv_grid=dkdv_grid, dq_grid=dq_grid, dkdv_constexprs=dkdv, dq_constexprs=dq)


def _smaller_backward_plan(plan: _BackwardPlan, L: int, S: int) -> Optional[_BackwardPlan]:
    """One pipeline stage for both kernels, then half of the larger program's larger tile (the
    walked one on a tie), not below 16; None when nothing is left to shrink."""
    dkdv, dq = dict(plan.dkdv_constexprs), dict(plan.dq_constexprs)
    if dkdv["num_stages"] > 1 or dq["num_stages"] > 1:
        for c in (dkdv, dq):
            c["num_stages"] = c["NUM_STAGES"] = 1
        return plan._replace(dkdv_constexprs=dkdv, dq_constexprs=dq)
    # (constexprs, walked tile, owned tile): dK/dV owns keys and walks queries; dQ the other way.
    programs = [(dkdv, "BLOCK_M", "BLOCK_N"), (dq, "BLOCK_N", "BLOCK_M")]
    programs.sort(key=lambda p: p[0]["BLOCK_M"] * p[0]["BLOCK_N"], reverse=True)
    for c, walked, owned in programs:
        name = walked if c[walked] >= c[owned] else owned
        if c[name] > 16:
            c[name] //= 2
            break
    else:
        return None
    return _with_tiles(plan, dkdv, dq, L, S)


# [Note] Backward tiles the compiler made costly. The forward's rule ([Note] Tiles the compiler made
# costly, runtime.py) for the two walking kernels: after the first backward of a default plan, a
# kernel that spilled more than SPILL_LIMIT_BYTES per thread halves its walked tile, then its owned
# one (not below 32), and one whose shared memory exceeds its tiles by STAGED_GATHER_BYTES (the
# pipeliner staging a mod's gathered tiles) drops a stage; one step per backward until neither
# holds. Tiles pinned through kernel_options or chosen by AUTOTUNE are kept.


def _backward_tile_bytes(c: dict, elem_bytes: int, walked: str, owned: str) -> int:
    """The owned Q/dO or K/V tiles once, the walked ones per pipeline stage."""
    width = c["QK_HEAD_DIM_P2"] + c["V_HEAD_DIM_P2"]
    return (c[owned] + c[walked] * max(1, c["num_stages"])) * width * elem_bytes


def _backward_plan_after_compile(plan: _BackwardPlan, dkdv_kernel, dq_kernel, L: int, S: int, elem_bytes: int,
                                 has_mods: bool) -> _BackwardPlan:
    """The next plan after a default plan's kernels ran compiled (see [Note] Backward tiles the
    compiler made costly): a cheaper one, or the same one marked as seen."""
    dkdv, dq = dict(plan.dkdv_constexprs), dict(plan.dq_constexprs)
    changed = False
    # (constexprs, compiled kernel, walked tile, owned tile)
    for c, kernel, walked, owned in ((dkdv, dkdv_kernel, "BLOCK_M", "BLOCK_N"), (dq, dq_kernel, "BLOCK_N", "BLOCK_M")):
        if spilled_bytes(kernel) > runtime.SPILL_LIMIT_BYTES and max(c[walked], c[owned]) > 32:
            c[walked if c[walked] > 32 else owned] //= 2
            changed = True
            continue
        shared = getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
        if (has_mods and c["num_stages"] > 1
                and shared - _backward_tile_bytes(c, elem_bytes, walked, owned) >= runtime.STAGED_GATHER_BYTES):
            c["num_stages"] = c["NUM_STAGES"] = c["num_stages"] - 1
            changed = True
    if not changed:
        return plan._replace(check_compiled=False)
    return _with_tiles(plan, dkdv, dq, L, S)


def _lower_score_grad(traced: Optional[TracedMod], tanh_approx: bool, variant):
    if traced is None:
        return None
    return lowering.lower_score_grad(traced, prefix="sm_", tanh_approx=tanh_approx, variant=variant)


class BackwardKernel(KernelFamily):
    """The backward kernels of one pair of traced mods (see [Note] Cache keys in runtime.py): one
    compiled source per lowering variant, one launch plan per problem. ``compiled`` also lowers the
    score_mod's gradient, so a gradient that cannot be lowered raises (naming the op and the line)
    before any kernel runs."""

    def __init__(self, score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool):
        super().__init__(score, mask, tanh_approx=tanh_approx)
        self.last_config: Optional[BackwardConfig] = None
        self.last_plan: Optional[_BackwardPlan] = None  # what the latest launch used (FLEXATTN_DEBUG reads it)

    def _compile(self, variants: tuple) -> CompiledBackward:
        spec = KernelSpec("backward", **self._lowered_mods(variants),
                          score_grad=_lower_score_grad(self.score, self.tanh_approx, variants[0]))
        return self._load(CompiledBackward, spec, variants)

    def prepare(self, q, k, block_mask) -> None:
        """Lower and compile for this call's lengths now (at the forward), so a mod whose gradient
        cannot be lowered fails before any kernel runs."""
        B, Hq, L, _ = q.shape
        self.compiled(index_bounds(B, Hq, L, k.shape[2]))

    # ---------------------------------------------------------------- launch
    def __call__(self, q, k, v, out, lse, grad_out, grad_lse, block_mask: BlockMask, scale: float,
                 score_captured, mask_captured, options: dict):
        global launches
        B, Hq, L, E = q.shape
        Bk, Hkv, S, Ev = v.shape
        tables = launch_tables(block_mask)
        bwd_tables = backward_tables(block_mask)
        plan_key = (
            q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), grad_out.stride(), out.stride(),
            q.dtype, q.device, block_mask.BLOCK_SIZE, tables.plan_key, scale > 0, grad_lse is not None,
            tuple(sorted(options.items())) if options else (),
            torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None,
        )
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._remember_plan(plan_key, self._plan(
                q, k, v, grad_out, block_mask, tables, scale, score_captured, mask_captured, options))
        module = plan.compiled.module
        if plan.dkdv_constexprs["USE_TMA"] and (q.data_ptr() | k.data_ptr() | v.data_ptr() | grad_out.data_ptr()) % 16:
            # Same shapes and strides as the plan's first call, but an unaligned view this time.
            plan = plan._replace(dkdv_constexprs={**plan.dkdv_constexprs, "USE_TMA": False},
                                 dq_constexprs={**plan.dq_constexprs, "USE_TMA": False})
        self.last_plan = plan
        if plan.dkdv_constexprs["USE_TMA"]:
            _install_tma_allocator()  # this thread's: autograd runs the backward in a worker thread

        # -- preprocess: DELTA ----
        delta = _empty((B, Hq, L), torch.float32, q.device)
        dlse = grad_lse.contiguous().float() if grad_lse is not None else delta
        pre_block = plan.preprocess_block
        launch(module.flex_attention_backward_preprocess, (triton_cdiv(L, pre_block), Hq, B),
               (out, grad_out, dlse, delta, *out.stride(), *grad_out.stride(), L),
               dict(V_HEAD_DIM=Ev, V_HEAD_DIM_P2=max(16, _next_pow2(Ev)), BLOCK_M=pre_block,
                    HAS_DLSE=grad_lse is not None))

        # -- captured tensors and their gradient buffers ----
        trainable = plan.compiled.spec.score_grad.trainable if plan.compiled.spec.score_grad else ()
        grad_buffers = [torch.zeros(score_captured[i].shape, dtype=torch.float32, device=q.device) for i in trainable]
        score_args = mod_launch_args(score_captured) + grad_buffers
        mask_args = mod_launch_args(mask_captured)

        k_strides, v_strides = k.stride(), v.stride()
        broadcast_kv = Bk == 1 and B > 1
        if broadcast_kv:
            k_strides, v_strides = (0,) + k_strides[1:], (0,) + v_strides[1:]
            # Each query batch writes its own slice; the slices are summed below (float32).
            dk = _empty((B, Hkv, S, E), torch.float32, q.device)
            dv = _empty((B, Hkv, S, Ev), torch.float32, q.device)
        else:
            dk = _empty(k.shape, k.dtype, q.device)
            dv = _empty(v.shape, v.dtype, q.device)
        dq = _empty(q.shape, q.dtype, q.device)
        lse = lse.contiguous()

        try:
            dkdv_kernel = launch(module.flex_attention_backward_dkdv, plan.dkdv_grid, (
                q, k, v, grad_out, lse, delta, dk, dv,
                bwd_tables.q_num_blocks, bwd_tables.q_indices, bwd_tables.full_q_num_blocks, bwd_tables.full_q_indices,
                *q.stride(), *k_strides, *v_strides, *grad_out.stride(), *dk.stride(), *dv.stride(),
                bwd_tables.q_num_blocks.shape[2], bwd_tables.q_indices.shape[3], bwd_tables.full_q_indices.shape[3],
                L, S, scale, *score_args, *mask_args), plan.dkdv_constexprs)
            nb, idx, fnb, fidx = tables.kv_num_blocks, tables.kv_indices, tables.full_kv_num_blocks, tables.full_kv_indices
            dq_kernel = launch(module.flex_attention_backward_dq, plan.dq_grid, (
                q, k, v, grad_out, lse, delta, dq,
                nb, idx, fnb, fidx,
                *q.stride(), *k_strides, *v_strides, *grad_out.stride(), *dq.stride(),
                nb.shape[2], idx.shape[3], fidx.shape[3],
                L, S, scale, *score_args, *mask_args), plan.dq_constexprs)
        except Exception as err:
            if not _is_out_of_resources(err):
                raise
            # See [Note] Resource fallback in runtime.py: a mod that gathers per pair (T5's buckets
            # at d=128 on the H100) can need more shared memory than the default tiles leave. A
            # smaller plan is kept for this problem and the whole backward runs again from fresh
            # buffers (a kernel that did run may have added into the captured tensors' gradients).
            smaller = None if _backward_pinned(options) else _smaller_backward_plan(plan, L, S)
            if smaller is None:
                raise ResourceError(
                    f"the Triton backward for score_mod '{self.score.name if self.score else None}' and mask_mod "
                    f"'{self.mask.name if self.mask else None}' does not fit this GPU with tiles {self.last_config} "
                    f"({err}); pass smaller tiles (kernel_options BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, "
                    "bwd_num_stages) or run it with kernel_options={'BACKEND': 'PYTORCH'}"
                ) from err
            self._plans[plan_key] = smaller
            return self(q, k, v, out, lse, grad_out, grad_lse, block_mask, scale, score_captured, mask_captured,
                        options)
        launches += 1
        if plan.check_compiled and self._plans.get(plan_key) is plan:
            self._plans[plan_key] = _backward_plan_after_compile(
                plan, dkdv_kernel, dq_kernel, L, S, q.element_size(), self.score is not None or self.mask is not None)
        if broadcast_kv:
            dk = dk.sum(0, keepdim=True).to(k.dtype)
            dv = dv.sum(0, keepdim=True).to(v.dtype)
        captured_grads: list = [None] * len(score_captured)
        for i, buf in zip(trainable, grad_buffers):
            captured_grads[i] = buf.to(score_captured[i].dtype)
        return dq, dk, dv, captured_grads

    def _plan(self, q, k, v, grad_out, block_mask, tables, scale, score_captured, mask_captured,
              options) -> _BackwardPlan:
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        compiled = self.compiled(index_bounds(B, Hq, L, S))
        cfg = select_backward_config(q.device, q.dtype, E, Ev, sparse_q, sparse_kv, self.mask is not None,
                                     tables.stats.mean_blocks)
        chosen_here = False
        if _backward_pinned(options):
            cfg = _pinned_backward_config(options, cfg, sparse_q, sparse_kv)
        elif options.get("AUTOTUNE") and not interpreter_enabled() and q.device.type == "cuda":
            cfg = self._tuned(q, k, v, block_mask, scale, score_captured, mask_captured, compiled, cfg)
        else:
            chosen_here = q.device.type == "cuda" and not interpreter_enabled()
        self.last_config = cfg
        use_tma = bool(options.get("USE_TMA", cfg.USE_TMA)) and _tma_compatible(q, k, v, grad_out)
        dkdv_launch, dq_launch = cfg.dkdv(), cfg.dq()
        common = dict(
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1],
            GQA_GROUP=Hq // Hkv,
            QK_HEAD_DIM=E, QK_HEAD_DIM_P2=max(16, _next_pow2(E)),
            V_HEAD_DIM=Ev, V_HEAD_DIM_P2=max(16, _next_pow2(Ev)),
            SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
            HAS_SCORE_MOD=self.score is not None,
            SCALE_FIRST=self.score is not None or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.mask is not None, HAS_FULL_BLOCKS=tables.has_full,
            INPUT_PRECISION=_input_precision(q.dtype),
            UPCAST_DOTS=q.dtype == torch.bfloat16 and interpreter_enabled(),
            USE_TMA=use_tma,
        )
        # Each kernel checks bounds along its own tile (EVEN_* of its tile) and along the sparse
        # blocks it walks (whole blocks: EVEN_* of the BlockMask's block).
        dkdv = dict(common, BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1,
                    EVEN_M=L % sparse_q == 0, EVEN_N=S % cfg.BLOCK_N1 == 0, NUM_STAGES=dkdv_launch.num_stages,
                    num_warps=dkdv_launch.num_warps, num_stages=dkdv_launch.num_stages)
        dq = dict(common, BLOCK_M=cfg.BLOCK_M2, BLOCK_N=cfg.BLOCK_N2,
                  EVEN_M=L % cfg.BLOCK_M2 == 0, EVEN_N=S % sparse_kv == 0, NUM_STAGES=dq_launch.num_stages,
                  num_warps=dq_launch.num_warps, num_stages=dq_launch.num_stages)
        pre_block = 64 if not interpreter_enabled() else 128
        return _BackwardPlan(
            (triton_cdiv(S, cfg.BLOCK_N1), Hkv, B), (triton_cdiv(L, cfg.BLOCK_M2), Hq, B),
            pre_block, dkdv, dq, compiled, check_compiled=chosen_here,
        )


    def _tuned(self, q, k, v, block_mask, scale, score_captured, mask_captured, compiled,
               default: BackwardConfig) -> BackwardConfig:
        """AUTOTUNE: time a few tile shapes once per shape class; the choice is kept in the same file
        as the forward's (runtime.tuned_configs), so later processes reuse it. A stored choice sets
        only the speed: every fact correctness depends on is derived from the call in _plan."""
        import triton
        import triton.testing

        E, Ev = q.shape[-1], v.shape[-1]
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        key = "|".join(str(x) for x in (
            "backward", compiled.spec.readable_name(), compiled.source_digest, torch.cuda.get_device_name(q.device),
            triton.__version__, q.dtype, _input_precision(q.dtype), E, Ev, _next_pow2(q.shape[2]),
            _next_pow2(k.shape[2]), q.shape[1] // k.shape[1], sparse_q, sparse_kv,
        ))
        stored = tuned_configs.get_entry(key)
        if stored is not None:
            return BackwardConfig(**stored)
        runtime.autotune_runs += 1
        shapes = [(64, 128, 128, 64), (32, 128, 128, 32), (64, 64, 64, 64), (32, 64, 64, 32)]
        candidates = {default} | {
            _fit_backward(BackwardConfig(*shape, warps, stages, USE_TMA=default.USE_TMA), sparse_q, sparse_kv)
            for shape in shapes for warps in (4, 8) for stages in (2, 3)
        }
        limit = max_shared_memory(q.device)
        qk_p2, v_p2 = _next_pow2(E), _next_pow2(Ev)
        # Timing inputs: the call's own tensors, a made-up output and LSE (speed does not depend on them).
        out = torch.randn(q.shape[:-1] + (Ev,), dtype=q.dtype, device=q.device)
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        grad_out = torch.randn_like(out)
        timings = []
        for cfg in sorted(candidates, key=lambda c: (c != default, str(c))):
            if backward_shared_memory_bytes(cfg, q.dtype.itemsize, qk_p2, v_p2) > limit:
                continue
            pinned = {name: getattr(cfg, name) for name in _BACKWARD_TILE_KEYS}
            pinned.update(bwd_num_warps=cfg.num_warps, bwd_num_stages=cfg.num_stages, USE_TMA=cfg.USE_TMA)

            def run():
                self(q, k, v, out, lse, grad_out, None, block_mask, scale, score_captured, mask_captured, pinned)

            try:
                timings.append((triton.testing.do_bench(run, warmup=3, rep=20, return_mode="median"), cfg))
            except Exception:  # a shape the compiler rejects (resources) is simply not a candidate
                continue
        best = min(timings, key=lambda t: t[0])[1] if timings else default
        tuned_configs.put_entry(key, dict(best.__dict__))
        return best


_kernels: "OrderedDict[tuple, BackwardKernel]" = OrderedDict()  # see [Note] Cache keys in runtime.py


def backward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool = False) -> BackwardKernel:
    """The backward kernels for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, BackwardKernel, score, mask, tanh_approx)
