"""The Triton decode kernels: split-KV flash-decoding for short queries.

The decode kernel family (templates/decode.py.jinja), for inference. A plan holds up to two steps:

1. ``"partial"``, grid (splits, head groups x row tiles, batch): each program packs the query rows of the
   heads that share one key/value head (all queries of each) into one tile, so K and V are read once
   per GQA group, and walks its share of the BlockMask's listed key blocks, writing an
   unnormalised output, row max and row sum per split to float32 scratch;
2. ``"merge"``, grid (row chunks, head groups x row tiles, batch): combines the splits into the output
   and the LSE. With one split the partial kernel writes the output itself and no merge runs.

The splits are what fill the GPU when batch x key/value heads is small: a decoding step reads the
whole KV cache, and one program per (batch, head) would leave most SMs idle. The same score_mod /
mask_mod lowering as the forward, with ``h`` and ``q_idx`` as [BLOCK_M, 1] columns (see [Note]
Decode tiles in the template).

Caches follow [Note] Cache keys in kernels/family.py: ``_kernels`` (TracedMod pair, tanh flag),
``DecodeKernel._compiled`` (lowering variants), ``DecodeKernel._plans`` (shapes, strides, dtype,
device, BlockMask table shapes, the group check, flags, options), ``DecodeKernel._prepared`` (the
plans' key: [Note] Prepared decode launches), the group check on the BlockMask (kernels/tables.py).
"""

from __future__ import annotations

from collections import OrderedDict
from fractions import Fraction
from typing import Optional

import torch

from ..codegen.params import DECODE_MERGE, DECODE_PARTIAL
from ..errors import InvalidInputError, ResourceError
from ..masks import BlockMask
from ..masks.layout import cdiv
from ..trace import TracedMod
from .configs import input_precision, kv_as_float16, next_pow2, select_decode_config, upcast_dots
from .ahead import recording
from .family import CompiledKernel, KernelFamily, Plan, PreparedLaunch, Problem, Step, cached_kernel
from .launch import (
    attention_output_spec, empty_output, empty_strided_output, finished_output, interpreter_enabled, kept_scratch,
    kv_strides, launch, mod_launch_args,
)
from .tables import groups_share_tables, launch_tables

__all__ = ["DecodeKernel", "DecodeLaunch", "decode_kernel", "unsupported_reason", "launches", "balanced_splits",
           "MAX_AUTO_QUERY_LEN"]

launches = 0  # decode calls in this process (tests check that the decode kernels, not the forward, ran)

# flex_attention picks the decode kernels by itself for queries up to this length (on the Triton
# backend, without gradients): graph-timed, they beat the forward at every q_len up to 64 in every
# shape measured, and lost to it at 128 (docs/benchmarks_log.md, "Decoding: the split-KV decode
# kernel"). tests/test_gpu_decode.py checks the automatic choice's results at 17 to 64 rows on the GPU.
MAX_AUTO_QUERY_LEN = 64


def unsupported_reason(q: torch.Tensor, block_mask: BlockMask) -> Optional[str]:
    """Why the decode kernels cannot take this call, or None when they can."""
    q_block = block_mask.BLOCK_SIZE[0]
    if q.shape[2] > q_block:
        return (f"the decode kernels take queries that fit in one query block of the BlockMask: q_len "
                f"{q.shape[2]} is longer than its query block size {q_block}")
    return None


# Splits, from a CUDA-graph-timed sweep (docs/benchmarks_log.md, "Decoding: the split-KV decode
# kernel"): about two programs per SM was the best or close to it in every swept case, with at least
# MIN_KEYS_PER_SPLIT keys per split so a program's loop still streams, and at most MAX_MERGED_PER_ROW
# // Ev splits: the merge reads splits x Ev floats per row, and more splits than that cost more in the
# merge than they gain. Within that, the count whose programs spread evenly over the SMs (see
# balanced_splits).
WAVES = 2
MAX_MERGED_PER_ROW = 8192
MIN_KEYS_PER_SPLIT = {64: 512, 128: 1024, 256: 1024}
MIN_FILL = 0.75  # of WAVES programs per SM: the fewest programs balanced_splits may choose


def choose_num_splits(device: torch.device, programs: int, kv_len: int, kv_block: int, head_dim: int = 64) -> int:
    """Splits of each program's key blocks, from the cache's length (not the mask's content, so a
    plan stays the same while a mask grows step by step)."""
    max_blocks = cdiv(kv_len, kv_block)
    if interpreter_enabled() or device.type != "cuda":
        return max(1, min(2, max_blocks))  # the interpreter runs programs one by one: few are faster
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = cdiv(WAVES * sms, programs)
    bucket = next((d for d in (64, 128) if head_dim <= d), 256)
    max_splits = max(1, MAX_MERGED_PER_ROW // next_pow2(head_dim))
    cap = max(1, min(wanted, kv_len // MIN_KEYS_PER_SPLIT[bucket], max_blocks, max_splits))
    return balanced_splits(programs, cap, sms)


def balanced_splits(programs: int, cap: int, sms: int) -> int:
    """The split count, at most ``cap``, whose programs x splits spread most evenly over ``sms`` SMs,
    among those that still give at least MIN_FILL x WAVES programs per SM (else ``cap``).

    A step lasts as long as its busiest SM: 272 programs on 132 SMs put three on 8 SMs and two on the
    rest, and ran longer than 256 programs (16 head groups, 17 splits against 16; docs/benchmarks_log.md,
    "Decoding: the split-KV decode kernel"). Ties go to more splits."""
    floor = MIN_FILL * WAVES * sms
    candidates = [s for s in range(1, cap + 1) if programs * s >= floor]
    if not candidates:
        return cap
    # Fraction: equal balances (256/264 and 384/396) must compare equal, so the tie rule decides.
    return max(candidates, key=lambda s: (Fraction(programs * s, sms * cdiv(programs * s, sms)), s))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


MERGE_ROWS = 2
MERGE_ELEMENTS = 4096  # partial outputs a merge program combines (all its splits, when they fit)
MERGE_STEP_ELEMENTS = 8192  # at most this many loaded per step of its loop
MAX_BLOCK_M_GPU = 64  # rows of one partial program; more heads x queries are cut into row tiles


class DecodeKernel(KernelFamily):
    """The decode kernels of one pair of traced mods: one compiled source per lowering variant, one
    launch plan per problem (see [Note] Cache keys in kernels/family.py)."""

    kind = "decode"

    def __call__(self, q, k, v, block_mask: BlockMask, scale: float, score_captured, mask_captured, *,
                 need_lse: bool, options: dict):
        """``(out, lse or None)`` for queries that fit one query block of the mask (see unsupported_reason)."""
        global launches
        if q.shape[2] > block_mask.BLOCK_SIZE[0]:  # unsupported_reason's one rule, asked without the call
            reason = unsupported_reason(q, block_mask)
            raise InvalidInputError(f"kernel_options BACKEND='TRITON_DECODE': {reason}; use 'TRITON' or 'AUTO'")
        tables = launch_tables(block_mask)
        problem = Problem(q, k, v, block_mask, tables, scale, score_captured, mask_captured, options, need_lse)
        key = _plan_key(problem)
        result = self._prepared_result(key, problem)
        if result is None:
            seen = key in self._plans
            result = self._run(key, problem)
            if seen:
                self._prepare(key, problem)
        launches += 1
        return result

    def _prepare(self, key: tuple, problem: Problem) -> None:
        """After the second call of ``key`` ran its plan the long way: that launch, kept for the next
        calls of the key ([Note] Prepared decode launches)."""
        plan = self._plans.get(key)
        if plan is None or plan.check_compiled or recording():
            return
        self._keep_prepared(key, DecodeLaunch(self, plan, problem))

    def _launch(self, plan: Plan, problem: Problem):
        return DecodeLaunch(self, plan, problem).run(problem), {}

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        q, k, v, tables, scale, options = problem.q, problem.k, problem.v, problem.tables, problem.scale, problem.options
        need_lse, shared = problem.need_lse, _groups_share(problem)
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        group = Hq // Hkv
        sparse_kv = problem.block_mask.BLOCK_SIZE[1]
        cfg = select_decode_config(q, v, sparse_kv, options)
        # See [Note] Decode tiles: a whole GQA group per program when its heads share their tables.
        heads = group if shared else 1
        rows = heads * L
        max_block_m = 128 if interpreter_enabled() or q.device.type != "cuda" else MAX_BLOCK_M_GPU
        block_m = min(next_pow2(max(16, rows)), max_block_m)
        row_tiles = cdiv(rows, block_m)
        programs = Hq // heads * row_tiles
        splits = options.get("DECODE_NUM_SPLITS")
        if splits is None:
            splits = choose_num_splits(q.device, B * programs, S, sparse_kv, Ev)
        elif isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
            raise InvalidInputError(f"kernel_options['DECODE_NUM_SPLITS'] must be an int >= 1, got {splits!r}")
        ev_p2 = max(16, next_pow2(Ev))
        constexprs = dict(
            NUM_HEADS_Q=Hq, QUERY_LEN=L, HEADS=heads, ROW_TILES=row_tiles, NUM_SPLITS=splits,
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1], GQA_GROUP=group,
            QK_HEAD_DIM=E, QK_HEAD_DIM_P2=max(16, next_pow2(E)), V_HEAD_DIM=Ev, V_HEAD_DIM_P2=ev_p2,
            SPARSE_KV_BLOCK_SIZE=sparse_kv, BLOCK_M=block_m, BLOCK_N=cfg.BLOCK_N, EVEN_N=S % sparse_kv == 0,
            HAS_SCORE_MOD=self.has_score_mod,
            # The mods see the scaled score; the scale folds into the exp2 only when it is positive.
            SCALE_FIRST=self.has_score_mod or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.has_mask_mod, HAS_FULL_BLOCKS=tables.has_full, OUTPUT_LSE=need_lse,
            INPUT_PRECISION=input_precision(q.dtype), NUM_STAGES=cfg.num_stages,
            UPCAST_DOTS=upcast_dots(q.dtype) and not kv_as_float16(q, k, v),
            KV_AS_FLOAT16=kv_as_float16(q, k, v),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        DECODE_PARTIAL.check_constexprs(constexprs)
        steps = {"partial": Step(DECODE_PARTIAL, (splits, programs, B), constexprs)}
        if splits > 1:
            # Few rows and a slice of the columns per merge program, so that even batch 1 spreads the
            # merge over many programs, and a chunk of splits per step: up to 8K float32 partial
            # outputs in flight per program (see the merge kernel's loop).
            merge_m = min(block_m, MERGE_ROWS)
            merge_d = min(ev_p2, max(16, _pow2_floor(MERGE_ELEMENTS // (next_pow2(splits) * merge_m))))
            split_chunk = min(next_pow2(splits), max(1, MERGE_STEP_ELEMENTS // (merge_m * merge_d)))
            d_chunks = ev_p2 // merge_d
            merge = dict(
                NUM_HEADS_Q=Hq, QUERY_LEN=L, HEADS=heads, ROW_TILES=row_tiles, NUM_SPLITS=splits,
                NUM_SPLITS_P2=next_pow2(splits), SPLIT_CHUNK=split_chunk, V_HEAD_DIM=Ev, V_HEAD_DIM_P2=ev_p2,
                BLOCK_M=block_m, MERGE_M=merge_m, MERGE_D=merge_d, D_CHUNKS=d_chunks, OUTPUT_LSE=need_lse,
                num_warps=4,
            )
            DECODE_MERGE.check_constexprs(merge)
            steps["merge"] = Step(DECODE_MERGE, (cdiv(min(block_m, rows), merge_m) * d_chunks, programs, B), merge)
        # The scratch rows of the splits: programs x splits x BLOCK_M.
        return Plan(compiled, steps, (L, S), q.element_size(), extra=(B * programs * splits * block_m,))

    def _smaller_plan(self, plan: Plan, options: dict) -> Optional[Plan]:
        """One pipeline stage, then half the key tile; None once one stage of 16 keys is left (see
        [Note] Resource fallback in kernels/family.py)."""
        c = plan.constexprs("partial")
        if c["num_stages"] > 1:
            return plan.with_constexprs("partial", num_stages=1, NUM_STAGES=1)
        if c["BLOCK_N"] > 16:
            return plan.with_constexprs("partial", BLOCK_N=c["BLOCK_N"] // 2)
        return None

    def _resource_error(self, plan: Plan, err: Exception) -> ResourceError:
        return ResourceError(
            f"the Triton decode kernel for {self._names()} does not fit this GPU even with 16-key tiles and one "
            f"pipeline stage ({err}); simplify the mod or use kernel_options={{'BACKEND': 'TRITON'}}"
        )


# [Note] Prepared decode launches. A warm decode call of a plan key that ran the long way twice
# launches the DecodeLaunch kept for it ([Note] Prepared eager launches in kernels/family.py): the
# output's and the scratch's shapes and strides and the partial kernel's ints, worked out once. The
# long way makes a DecodeLaunch at each call and runs it once, so both ways launch the same
# arguments. Prepared at the second call, not the first: a cache that grows by a token a step is a
# new key at each step, and would prepare launches never served.
# The key (_plan_key) holds every int the launch passes: q's, k's and v's shapes (so the KV length)
# and strides (so the output's layout and a broadcast key/value batch of 1), the tables' shapes and
# widths (SPARSE_ROWS, IDX_COLS, FULL_IDX_COLS), the dtypes (so the output's) and device, need_lse,
# kernel_options and the group check (enable_gqa shows in the head counts). What it leaves out, the
# plan and the scale, PreparedLaunch.serves checks at every call. Read at every call, as the long
# way reads them: q, k and v; the tables, through launch_tables' stamps (a paged cache's mask
# converted each step, a mask changed in place); the mods' values (captured tensors as they are
# then, replaced or changed in place; the Python numbers a mod reads; the page tables a paged mod
# reads). Nothing of a call's tensors is kept. The output and LSE are allocated per call; the
# splits' scratch is kept per thread and stream by the rules of flexattn/cuda_graphs.py ([Note] Kept
# scratch in kernels/launch.py), so a capture or a graph tree's warm-up allocates its own, as the
# forward's calls do. FP8 and mixed dtypes are prepared too: the output's dtype comes from
# attention_output_spec and finished_output converts it, as on the long way.


class DecodeLaunch(PreparedLaunch):
    """The decode kernels' launches of one plan for the calls of one plan key: the output's and the
    scratch's shapes and the partial kernel's ints, from the call it was made for (see [Note]
    Prepared decode launches). ``run(problem)`` returns ``(out, lse or None)``."""

    def __init__(self, family: DecodeKernel, plan: Plan, problem: Problem):
        q, k, v, tables = problem.q, problem.k, problem.v, problem.tables
        B, Hq, L, _ = q.shape
        self.family, self.plan, self.scale, self.need_lse = family, plan, problem.scale, problem.need_lse
        self.partial, self.merge = plan.steps["partial"], plan.steps.get("merge")
        self.partial_kernel = plan.compiled.kernel(DECODE_PARTIAL)
        self.merge_kernel = plan.compiled.kernel(DECODE_MERGE) if self.merge is not None else None
        self.out_shape, out_strides, self.out_dtype = attention_output_spec(q, v.shape[3])
        self.out_strides, self.lse_shape = out_strides, (B, Hq, L)
        if self.merge is not None:
            # The splits' ACC, M and L rows ([Note] Kept scratch in kernels/launch.py).
            (rows,) = plan.extra
            self.scratch_shapes = ((rows, self.partial.constexprs["V_HEAD_DIM_P2"]), (rows,), (rows,))
        k_strides, v_strides = kv_strides(k, v, B)
        self.fixed = dict(
            stride_q=q.stride(), stride_k=k_strides, stride_v=v_strides, stride_o=out_strides,
            SPARSE_ROWS=tables.kv_num_blocks.shape[2], IDX_COLS=tables.kv_indices.shape[3],
            FULL_IDX_COLS=tables.full_kv_indices.shape[3], KV_LEN=k.shape[2], SM_SCALE=problem.scale,
        )

    def run(self, problem: Problem):
        q, tables, family = problem.q, problem.tables, self.family
        device = q.device
        out = empty_strided_output(self.out_shape, self.out_strides, self.out_dtype, device)
        lse = empty_output(self.lse_shape, torch.float32, device) if self.need_lse else out
        if self.merge is None:
            acc_s = m_s = l_s = out  # unused: one split writes the output directly
        else:
            acc_s, m_s, l_s = kept_scratch(self.scratch_shapes, torch.float32, device)
        partial = self.partial
        launch(self.partial_kernel, partial.grid, DECODE_PARTIAL.pack(
            Q=q, K=problem.k, V=problem.v, OUT=out, LSE=lse, ACC_SCRATCH=acc_s, M_SCRATCH=m_s, L_SCRATCH=l_s,
            KV_NUM_BLKS=tables.kv_num_blocks, KV_IDX=tables.kv_indices, FULL_KV_NUM_BLKS=tables.full_kv_num_blocks,
            FULL_KV_IDX=tables.full_kv_indices,
            mods=mod_launch_args(problem.score_captured if family.has_score_mod else (),
                                 problem.mask_captured if family.has_mask_mod else ()),
            **self.fixed,
        ), partial.constexprs)
        merge = self.merge
        if merge is not None:
            launch(self.merge_kernel, merge.grid, DECODE_MERGE.pack(
                OUT=out, LSE=lse, ACC_SCRATCH=acc_s, M_SCRATCH=m_s, L_SCRATCH=l_s, stride_o=self.out_strides,
            ), merge.constexprs)
        family.last_plan = self.plan
        return finished_output(out, q), (lse if self.need_lse else None)


def _plan_key(problem: Problem) -> tuple:
    """What a decode plan depends on (see [Note] Cache keys in kernels/family.py), and with it every
    int its launch passes ([Note] Prepared decode launches)."""
    q, k, v, tables, options = problem.q, problem.k, problem.v, problem.tables, problem.options
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
        problem.block_mask.BLOCK_SIZE, tuple(tables.kv_num_blocks.shape), tables.kv_indices.shape[3],
        tables.full_kv_indices.shape[3], tables.has_full,
        groups_share_tables(problem.block_mask, q.shape[1] // k.shape[1]),  # content, never id(block_mask)
        problem.need_lse, problem.scale > 0, tuple(sorted(options.items())) if options else (),
        torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None,
    )


def _groups_share(problem: Problem) -> bool:
    """Whether the query heads of one GQA group share their tables ([Note] Decode tiles)."""
    return groups_share_tables(problem.block_mask, problem.q.shape[1] // problem.k.shape[1])


_kernels: "OrderedDict[tuple, DecodeKernel]" = OrderedDict()  # see [Note] Cache keys in kernels/family.py


def decode_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool = False) -> DecodeKernel:
    """The decode kernels for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, DecodeKernel, score, mask, tanh_approx)
