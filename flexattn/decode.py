"""The Triton decode kernels: split-KV flash-decoding for short queries.

Stage 4 of the pipeline for inference (trace -> lowering -> codegen -> runtime), beside the
forward's ``runtime.py``, whose tables, configuration helpers and cache rules it shares. Two
kernels, rendered together from ``templates/decode.py.jinja``:

1. partial, grid (splits, head groups x row tiles, batch): each program packs the query rows of the
   heads that share one key/value head (all queries of each) into one tile, so K and V are read once
   per GQA group, and walks its share of the BlockMask's listed key blocks, writing an
   unnormalised output, row max and row sum per split to float32 scratch;
2. merge, grid (row chunks, head groups x row tiles, batch): combines the splits into the output
   and the LSE. With one split the partial kernel writes the output itself and no merge runs.

The splits are what fill the GPU when batch x key/value heads is small: a decoding step reads the
whole KV cache, and one program per (batch, head) would leave most SMs idle. The same score_mod /
mask_mod lowering as the forward, with ``h`` and ``q_idx`` as [BLOCK_M, 1] columns (see [Note]
Decode tiles in the template).

Caches follow [Note] Cache keys in runtime.py: ``_kernels`` (TracedMod pair, tanh flag),
``DecodeKernel._compiled`` (lowering variants), ``DecodeKernel._plans`` (shapes, strides, dtype,
device, BlockMask table shapes, the group check, flags, options), the group check on the BlockMask
(BlockMask.derived).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from types import ModuleType
from typing import NamedTuple, Optional

import torch

from .block_mask import BlockMask
from .codegen import KernelSpec
from .errors import InvalidInputError, ResourceError
from .index_bounds import index_bounds
from .launch import launch
from .runtime import (
    KernelFamily, _empty, _input_precision, _is_out_of_resources, _next_pow2, _tile, interpreter_enabled,
    cached_kernel, launch_tables, max_shared_memory, mod_launch_args, triton_cdiv,
)
from .trace import TracedMod

__all__ = ["DecodeKernel", "decode_kernel", "unsupported_reason", "launches", "balanced_splits",
           "MAX_AUTO_QUERY_LEN"]

launches = 0  # decode calls in this process (tests check that the decode kernels, not the forward, ran)

# flex_attention picks the decode kernels by itself for queries up to this length (on the Triton
# backend, without gradients). Measured on the H100 (2026-11-24, graph-timed, ALiBi + causal at
# the cache's end, bf16; docs/benchmarks.md): the decode kernels beat the forward at every q_len
# from 1 to 64 in all four shapes tried, and lose at 128 for B=8 (2% at 16:2 d=128, 12% at MHA
# d=64). tests/test_gpu_decode.py checks the automatic choice's results at 17 to 64 rows on the GPU.
MAX_AUTO_QUERY_LEN = 64


# ------------------------------------------------------------------------------------ compiled kernels


@dataclass(frozen=True)
class CompiledDecode:
    spec: KernelSpec
    source: str
    source_digest: str
    module: ModuleType
    variants: tuple


# ------------------------------------------------------------------------------------ launch choices


def unsupported_reason(q: torch.Tensor, block_mask: BlockMask) -> Optional[str]:
    """Why the decode kernels cannot take this call, or None when they can."""
    q_block = block_mask.BLOCK_SIZE[0]
    if q.shape[2] > q_block:
        return (f"the decode kernels take queries that fit in one query block of the BlockMask: q_len "
                f"{q.shape[2]} is longer than its query block size {q_block}")
    return None


def _groups_share_tables(block_mask: BlockMask, group: int) -> bool:
    """Whether the query heads of every GQA group list the same key blocks (per batch and row), so
    one program can walk them for the whole group. One host sync per mask content."""
    def compute(mask: BlockMask) -> bool:
        tables = launch_tables(mask)
        heads = tables.kv_num_blocks.shape[1]
        if group == 1 or heads == 1:
            return True
        pairs = [(tables.kv_num_blocks, tables.kv_indices)]
        if tables.has_full:
            pairs.append((tables.full_kv_num_blocks, tables.full_kv_indices))
        checks = []
        for num, idx in pairs:
            used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
            listed = torch.where(used, idx, -1)  # padding entries may differ: compare listed ones only
            num = num.reshape(num.shape[0], heads // group, group, *num.shape[2:])
            listed = listed.reshape(listed.shape[0], heads // group, group, *listed.shape[2:])
            checks += [(num == num[:, :, :1]).all(), (listed == listed[:, :, :1]).all()]
        return bool(torch.stack(checks).all())

    return block_mask.derived(f"decode_groups_share_tables_{group}", compute)


# Splits, from a sweep on the H100 (bf16, CUDA-graph timings; docs/benchmarks.md): about two programs
# per SM was best or within 3% of it in every swept case, with at least MIN_KEYS_PER_SPLIT keys per
# split so a program's loop still streams, and at most MAX_MERGED_PER_ROW // Ev splits: the merge
# reads splits x Ev floats per row, and more splits than that cost more in the merge than they gain.
# Within that, the count whose programs spread evenly over the SMs (see balanced_splits).
WAVES = 2
MAX_MERGED_PER_ROW = 8192
MIN_KEYS_PER_SPLIT = {64: 512, 128: 1024, 256: 1024}
MIN_FILL = 0.75  # of WAVES programs per SM: the fewest programs balanced_splits may choose


def choose_num_splits(device: torch.device, programs: int, kv_len: int, kv_block: int, head_dim: int = 64) -> int:
    """Splits of each program's key blocks, from the cache's length (not the mask's content, so a
    plan stays the same while a mask grows step by step)."""
    max_blocks = triton_cdiv(kv_len, kv_block)
    if interpreter_enabled() or device.type != "cuda":
        return max(1, min(2, max_blocks))  # the interpreter runs programs one by one: few are faster
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton_cdiv(WAVES * sms, programs)
    bucket = next((d for d in (64, 128) if head_dim <= d), 256)
    max_splits = max(1, MAX_MERGED_PER_ROW // _next_pow2(head_dim))
    cap = max(1, min(wanted, kv_len // MIN_KEYS_PER_SPLIT[bucket], max_blocks, max_splits))
    return balanced_splits(programs, cap, sms)


def balanced_splits(programs: int, cap: int, sms: int) -> int:
    """The split count, at most ``cap``, whose programs x splits spread most evenly over ``sms`` SMs,
    among those that still give at least MIN_FILL x WAVES programs per SM (else ``cap``).

    A step lasts as long as its busiest SM: 272 programs on 132 SMs put three on 8 SMs and two on the
    rest, and took 7% longer than 256 programs on the H100 (16 head groups, 17 splits against 16;
    docs/benchmarks.md). Ties go to more splits."""
    floor = MIN_FILL * WAVES * sms
    candidates = [s for s in range(1, cap + 1) if programs * s >= floor]
    if not candidates:
        return cap
    # Fraction: equal balances (256/264 and 384/396) must compare equal, so the tie rule decides.
    return max(candidates, key=lambda s: (Fraction(programs * s, sms * triton_cdiv(programs * s, sms)), s))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


class DecodeConfig(NamedTuple):
    BLOCK_N: int
    num_warps: int
    num_stages: int


# (head dim up to, 16-bit inputs): a memory-bound loop wants deep pipelines of K/V tiles. d64: 90-93%
# of the copy bandwidth on the H100 at B=8 (docs/benchmarks.md). d128: CUDA-graph-timed sweeps on the
# H100 (bf16; GQA 12:2 at 32k and 16:2 at 16k with B=8, 16:2 at 128k with B=1; 14 tile/warp/stage
# choices) put 128-key tiles with 4 warps and 2 stages within 1% of the best at B=8 and 12% ahead of
# 64-key tiles at B=1; stages 2 to 4 alike; 32- or 16-key tiles 5-50% slower. K/V tiles through
# tensor descriptors were 1-3% slower than pointer loads in every case (not kept). Other GPUs and
# fp32 are not swept.
_GPU_DECODE_DEFAULTS = {
    (64, True): DecodeConfig(128, 4, 3),
    (128, True): DecodeConfig(128, 4, 2),
    (256, True): DecodeConfig(32, 4, 2),
    (64, False): DecodeConfig(64, 4, 3),
    (128, False): DecodeConfig(32, 4, 3),
    (256, False): DecodeConfig(16, 4, 2),
}
MERGE_ROWS = 2
MERGE_ELEMENTS = 4096  # partial outputs a merge program combines (all its splits, when they fit)
MERGE_STEP_ELEMENTS = 8192  # at most this many loaded per step of its loop
MAX_BLOCK_M_GPU = 64  # rows of one partial program; more heads x queries are cut into row tiles


def select_decode_config(q: torch.Tensor, v: torch.Tensor, sparse_kv: int, options: dict) -> DecodeConfig:
    if interpreter_enabled() or q.device.type != "cuda":
        cfg = DecodeConfig(128, 4, 1)
    else:
        bucket = next((d for d in (64, 128, 256) if max(q.shape[-1], v.shape[-1]) <= d), 256)
        cfg = _GPU_DECODE_DEFAULTS[(bucket, q.element_size() <= 2)]
    pinned = {k: options[k] for k in ("BLOCK_N", "num_warps", "num_stages") if options.get(k) is not None}
    for key, value in pinned.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"kernel_options['{key}'] must be an int, got {value!r}")
    cfg = cfg._replace(**pinned)
    if "BLOCK_N" in pinned:
        value = cfg.BLOCK_N
        if value < 16 or value & (value - 1) or sparse_kv % value:
            raise InvalidInputError(
                f"kernel_options['BLOCK_N'] must be a power of two >= 16 that divides the BlockMask's key "
                f"block size {sparse_kv}, got {value}"
            )
    else:
        cfg = cfg._replace(BLOCK_N=_tile(cfg.BLOCK_N, sparse_kv, "BLOCK_N"))
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise InvalidInputError(
            f"kernel_options num_warps must be 1, 2, 4, 8 or 16 and num_stages >= 1, got {cfg.num_warps} and "
            f"{cfg.num_stages}"
        )
    if q.device.type == "cuda" and not interpreter_enabled() and not pinned:
        limit = max_shared_memory(q.device)
        dims = _next_pow2(q.shape[-1]) + _next_pow2(v.shape[-1])
        while cfg.BLOCK_N * dims * q.element_size() * max(1, cfg.num_stages - 1) > limit and cfg.BLOCK_N > 16:
            cfg = cfg._replace(BLOCK_N=cfg.BLOCK_N // 2)
    return cfg


class _DecodePlan(NamedTuple):
    grid: tuple[int, int, int]
    merge_grid: Optional[tuple[int, int, int]]  # None: one split, no merge
    scratch_rows: int  # programs x splits x BLOCK_M
    constexprs: dict
    merge_constexprs: dict
    compiled: CompiledDecode


_PLANS_PER_KERNEL = 256


# ------------------------------------------------------------------------------------ kernels


class DecodeKernel(KernelFamily):
    """The decode kernels of one pair of traced mods: one compiled source per lowering variant, one
    launch plan per problem (see [Note] Cache keys in runtime.py)."""

    def __init__(self, score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool):
        super().__init__(score, mask, tanh_approx=tanh_approx)
        self.last_plan: Optional[_DecodePlan] = None  # what the latest launch used (tests and debugging read it)

    def _compile(self, variants: tuple) -> CompiledDecode:
        return self._load(CompiledDecode, KernelSpec("decode", **self._lowered_mods(variants)), variants)

    def __call__(self, q, k, v, block_mask: BlockMask, scale: float, score_captured, mask_captured, *,
                 need_lse: bool, options: dict):
        """``(out, lse or None)`` for queries that fit one query block of the mask (see unsupported_reason)."""
        global launches
        reason = unsupported_reason(q, block_mask)
        if reason is not None:
            raise InvalidInputError(f"kernel_options BACKEND='TRITON_DECODE': {reason}; use 'TRITON' or 'AUTO'")
        B, Hq, L, _ = q.shape
        Ev = v.shape[3]
        tables = launch_tables(block_mask)
        group = Hq // k.shape[1]
        shared = _groups_share_tables(block_mask, group)
        plan_key = (
            q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
            block_mask.BLOCK_SIZE, tuple(tables.kv_num_blocks.shape), tables.kv_indices.shape[3],
            tables.full_kv_indices.shape[3], tables.has_full, shared,  # content, never id(block_mask)
            need_lse, scale > 0, tuple(sorted(options.items())) if options else (),
            torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None,
        )
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self._remember_plan(plan_key, self._plan(q, k, v, block_mask, tables, shared, scale, need_lse, options))
        self.last_plan = plan

        out = _empty((B, Hq, L, Ev), q.dtype, q.device)
        lse = _empty((B, Hq, L), torch.float32, q.device) if need_lse else out
        if plan.merge_grid is None:
            acc_s = m_s = l_s = out  # unused: one split writes the output directly
        else:
            rows = plan.scratch_rows
            acc_s = _empty((rows, plan.constexprs["V_HEAD_DIM_P2"]), torch.float32, q.device)
            m_s = _empty((rows,), torch.float32, q.device)
            l_s = _empty((rows,), torch.float32, q.device)
        k_strides, v_strides = k.stride(), v.stride()
        if k.shape[0] == 1 and B > 1:  # a key/value batch of 1 broadcast over the queries' batch
            k_strides, v_strides = (0,) + k_strides[1:], (0,) + v_strides[1:]
        extra = mod_launch_args(score_captured if self.has_score_mod else (),
                                mask_captured if self.has_mask_mod else ())
        nb, idx, fnb, fidx = tables.kv_num_blocks, tables.kv_indices, tables.full_kv_num_blocks, tables.full_kv_indices
        module = plan.compiled.module
        try:
            launch(module.flex_attention_decode_partial, plan.grid, (
                q, k, v, out, lse, acc_s, m_s, l_s, nb, idx, fnb, fidx,
                *q.stride(), *k_strides, *v_strides, *out.stride(),
                nb.shape[2], idx.shape[3], fidx.shape[3], k.shape[2], scale, *extra), plan.constexprs)
        except Exception as err:
            # See [Note] Resource fallback in runtime.py: a smaller tile, kept for this problem.
            if not _is_out_of_resources(err):
                raise
            smaller = _smaller_plan(plan)
            if smaller is None:
                raise ResourceError(
                    f"the Triton decode kernel for score_mod '{self.score.name if self.score else None}' and mask_mod "
                    f"'{self.mask.name if self.mask else None}' does not fit this GPU even with 16-key tiles and one "
                    f"pipeline stage ({err}); simplify the mod or use kernel_options={{'BACKEND': 'TRITON'}}"
                ) from err
            self._plans[plan_key] = smaller
            return self(q, k, v, block_mask, scale, score_captured, mask_captured, need_lse=need_lse, options=options)
        if plan.merge_grid is not None:
            launch(module.flex_attention_decode_merge, plan.merge_grid,
                   (out, lse, acc_s, m_s, l_s, *out.stride()), plan.merge_constexprs)
        launches += 1
        return out, (lse if need_lse else None)

    def _plan(self, q, k, v, block_mask, tables, shared, scale, need_lse, options) -> _DecodePlan:
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        group = Hq // Hkv
        sparse_kv = block_mask.BLOCK_SIZE[1]
        compiled = self.compiled(index_bounds(B, Hq, L, S))
        cfg = select_decode_config(q, v, sparse_kv, options)
        # See [Note] Decode tiles: a whole GQA group per program when its heads share their tables.
        heads = group if shared else 1
        rows = heads * L
        max_block_m = 128 if interpreter_enabled() or q.device.type != "cuda" else MAX_BLOCK_M_GPU
        block_m = min(_next_pow2(max(16, rows)), max_block_m)
        row_tiles = triton_cdiv(rows, block_m)
        programs = Hq // heads * row_tiles
        splits = options.get("DECODE_NUM_SPLITS")
        if splits is None:
            splits = choose_num_splits(q.device, B * programs, S, sparse_kv, Ev)
        elif isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
            raise InvalidInputError(f"kernel_options['DECODE_NUM_SPLITS'] must be an int >= 1, got {splits!r}")
        ev_p2 = max(16, _next_pow2(Ev))
        constexprs = dict(
            NUM_HEADS_Q=Hq, QUERY_LEN=L, HEADS=heads, ROW_TILES=row_tiles, NUM_SPLITS=splits,
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1], GQA_GROUP=group,
            QK_HEAD_DIM=E, QK_HEAD_DIM_P2=max(16, _next_pow2(E)), V_HEAD_DIM=Ev, V_HEAD_DIM_P2=ev_p2,
            SPARSE_KV_BLOCK_SIZE=sparse_kv, BLOCK_M=block_m, BLOCK_N=cfg.BLOCK_N, EVEN_N=S % sparse_kv == 0,
            HAS_SCORE_MOD=self.has_score_mod,
            # The mods see the scaled score; the scale folds into the exp2 only when it is positive.
            SCALE_FIRST=self.has_score_mod or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.has_mask_mod, HAS_FULL_BLOCKS=tables.has_full, OUTPUT_LSE=need_lse,
            INPUT_PRECISION=_input_precision(q.dtype), NUM_STAGES=cfg.num_stages,
            UPCAST_DOTS=q.dtype == torch.bfloat16 and interpreter_enabled(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        grid = (splits, programs, B)
        merge_grid, merge_constexprs = None, {}
        if splits > 1:
            # Few rows and a slice of the columns per merge program, so that even batch 1 spreads the
            # merge over many programs, and a chunk of splits per step: up to 8K float32 partial
            # outputs in flight per program (see the merge kernel's loop).
            merge_m = min(block_m, MERGE_ROWS)
            merge_d = min(ev_p2, max(16, _pow2_floor(MERGE_ELEMENTS // (_next_pow2(splits) * merge_m))))
            split_chunk = min(_next_pow2(splits), max(1, MERGE_STEP_ELEMENTS // (merge_m * merge_d)))
            d_chunks = ev_p2 // merge_d
            merge_grid = (triton_cdiv(min(block_m, rows), merge_m) * d_chunks, programs, B)
            merge_constexprs = dict(
                NUM_HEADS_Q=Hq, QUERY_LEN=L, HEADS=heads, ROW_TILES=row_tiles, NUM_SPLITS=splits,
                NUM_SPLITS_P2=_next_pow2(splits), SPLIT_CHUNK=split_chunk, V_HEAD_DIM=Ev, V_HEAD_DIM_P2=ev_p2, BLOCK_M=block_m,
                MERGE_M=merge_m, MERGE_D=merge_d, D_CHUNKS=d_chunks, OUTPUT_LSE=need_lse, num_warps=4,
            )
        return _DecodePlan(grid, merge_grid, B * programs * splits * block_m, constexprs, merge_constexprs, compiled)


def _smaller_plan(plan: _DecodePlan) -> Optional[_DecodePlan]:
    """One pipeline stage, then half the key tile; None once one stage of 16 keys is left."""
    c = dict(plan.constexprs)
    if c["num_stages"] > 1:
        c["num_stages"] = c["NUM_STAGES"] = 1
    elif c["BLOCK_N"] > 16:
        c["BLOCK_N"] //= 2
    else:
        return None
    return plan._replace(constexprs=c)


_kernels: "OrderedDict[tuple, DecodeKernel]" = OrderedDict()  # see [Note] Cache keys in runtime.py


def decode_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool = False) -> DecodeKernel:
    """The decode kernels for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, DecodeKernel, score, mask, tanh_approx)
