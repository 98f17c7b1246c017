"""The Hopper forward family: one Gluon kernel per pair of traced mods
(templates/hopper_forward.py.jinja), its launch plans and its launches.

A warp-specialised FlashAttention forward (a loader warp feeding two consumer warpgroups, three on
a call without a mask at head dim 64, through an mbarrier ring, as FlashAttention-3 does) that
walks the BlockMask's forward tables as the portable forward does and writes the same output and
LSE, so the portable Triton backward runs after it unchanged. It covers the common case only;
:func:`problem_reason` and ``HopperForwardKernel.unsupported_reason`` say why a call is outside it,
and dispatch.py then runs the portable forward (or raises, when ``BACKEND='GLUON'`` pinned this one).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from ...codegen.params import HOPPER_FORWARD
from ...cuda_graphs import capturing
from ...masks import EVERY_BLOCK_FULL
from ...trace import TracedMod
from ..ahead import recording
from ..family import CompiledKernel, Plan, PreparedLaunch, Problem, Step, cached_kernel
from ..launch import (
    RepeatedLaunch, descriptor_over, descriptor_template, empty_attention_output, empty_output,
    empty_strided_output, kv_strides, launch, mod_launch_args,
)
from ..launch_order import rows_alike, tail_pairs
from ..tables import launch_tables, program_walks
from .common import (
    BLOCK, CONSUMER_REGS, HopperFamily, problem_reason, resident_in_registers, shared_layout, tensor_view,
)

__all__ = ["HopperForwardKernel", "WarmHopperForward", "PreparedHopperForward", "hopper_forward_kernel", "auto_reason",
           "launches"]

# The K/V ring's depth: Q (2 x 64 rows) plus STAGES K and V tiles fit in 228 KB of shared memory.
# At d=64 four stages were the best or level with it (docs/benchmarks_log.md, "Even ring depths in
# the Hopper kernels ...").
STAGES = {64: 4, 128: 2}


# [Note] Three consumers on an unmasked walk. A call without a BlockMask and without a mask_mod
# walks every key block, as full, in order, in every row (masks/create.py dense_block_mask, marked
# EVERY_BLOCK_FULL by construction). Its programs need not follow the BlockMask's 128-row query
# blocks, so a program can take 192 rows: three consumer warpgroups read each K/V tile the loader
# brings, as FlashAttention-3 and -4 do at head dim 64. Three consumers and the loader leave 160
# registers a consumer thread: Q stays in shared memory there. The last program of a (batch, head)
# may reach past the queries: its consumers there repeat the last 64 rows (consumer_row in the
# template), writing the same values. Three consumers were faster than two wherever rows visit many
# key blocks, and slower on short walks, where a row has fewer, longer programs (hence
# THREE_CONSUMERS_MIN_KEY_BLOCKS).
# At head dim 128 a consumer's output tile alone takes 64 of its 160 registers: two consumers there.
# Numbers: docs/benchmarks_log.md, "The d=64 forward without a mask: three consumer warpgroups taking
# turns, 192-row programs ..."; docs/data/three_consumers_h200_2026-11-28.json.
THREE_CONSUMERS = {64: True, 128: False}
THREE_CONSUMERS_MIN_KEY_BLOCKS = 24
THREE_CONSUMER_REGS = 160
# [Note] Turns on the tensor cores. Three consumers issue their products in a fixed round (0, 1, 2,
# 0, ...): before issuing a step's S_j and P_{j-1} V_{j-1} a consumer waits for its turn, and hands
# the turn on after issuing (FlashAttention-3's and -4's scheduler barrier, here one mbarrier per
# consumer). Each consumer's softmax then runs while the next ones' products do. With three
# consumers the turns were faster (level with soft-capping), the same bits; two consumers gained
# nothing from them, twice: they take no turns. Numbers: the same section;
# docs/data/three_consumers_turns_h200_2026-11-28.json.
#
# [Note] Programs across query blocks. With a mask_mod, rows of different query blocks walk
# different key blocks, and a 192-row program spans two of the BlockMask's 128-row query blocks
# (its first consumer's and its last one's; the middle one's is one of the two, since 64 divides
# 128). Such a program walks the union of the two blocks' walks (kernels/tables.py ProgramWalks,
# derived once per table content and kept on the mask). Each entry says what its block is to the
# first and to the last query block: full (no mask_mod), partial (the mask_mod decides) or not
# listed, where that consumer keeps nothing of the tile (its products are spent, its rows stay
# exact). Under a causal mask that is one tile in about a row's walk, at the diagonal. The walk is
# in ascending key order, where two consumers walk partial blocks first: sums in another order, not
# the same bits. Not for masks made for one call whose walks nobody keeps (they would be derived
# at every call; a compiled call's mask has them kept per table by compile/kept.py, [Note] What a
# compiled call's mask derives, kept), nor inside a CUDA-graph capture: its replays would read walks
# derived before it, whatever the tables hold by then, where the tables themselves are read as they
# are at each replay.
# Nor on short walks (fewer than THREE_CONSUMERS_MIN_KEY_BLOCKS key blocks a row on average), where
# the union's extra tiles weigh more: three consumers were faster on long walks (causal, prefix LM),
# level at about 16 key blocks a row and slower on short walks (sliding window, documents); compiled
# calls, which take the walks kept per table, gained as the eager ones did. Numbers:
# docs/benchmarks_log.md, "The d=64 forward with a mask: 192-row programs walk the union of two query
# blocks' walks ..." and "Compiled calls walk unions too ..."; docs/data/union_walks_h200_2026-11-28.json,
# docs/data/compiled_union_walks_h200_2026-11-28.json.
# UNION_WALKS: the head dims where it runs.
UNION_WALKS = {64: True, 128: False}

launches = 0  # kernels launched by this family (tests check the Gluon path really ran)
# AUTO's rule: at head dim 64 the portable forward is faster on rows that visit few key blocks (the
# program's fixed cost, barriers and partitions, is paid over few tiles) and with a score_mod on a
# masked walk (its arithmetic sits between the two matrix products, where a consumer warpgroup of 64
# rows has no slack); at head dim 128 the Gluon forward won on all seven paper variants. The
# threshold, AUTO_MIN_BLOCKS_D64, lies where the two crossed on causal masks at the 12-layer model's
# shapes. A score_mod without a mask_mod takes the Gluon forward since its calls got three consumers
# ([Note] Three consumers on an unmasked walk); with a mask_mod the portable forward stays, as it does
# for a mask_mod alone on few blocks (sliding window, documents). Numbers: docs/benchmarks_log.md,
# "Hopper forward in Gluon against FlashAttention-4 and cuDNN ...", "The output in the query's layout,
# and AUTO's forward rule at 4k ..." and "The d=64 forward without a mask: three consumer warpgroups ...".
AUTO_MIN_BLOCKS_D64 = 24


def auto_reason(q, block_mask, has_score_mod: bool = False, has_mask_mod: bool = False) -> Optional[str]:
    """Why AUTO leaves an eligible call to the portable forward, measured faster there (None: it does not)."""
    if q.shape[-1] == 64:
        if has_score_mod and has_mask_mod:
            return "at head dim 64 the portable forward is faster with a score_mod and a mask_mod"
        mean_blocks = launch_tables(block_mask).stats.mean_blocks
        if mean_blocks < AUTO_MIN_BLOCKS_D64:
            return (f"at head dim 64 the portable forward is faster on rows of few key blocks "
                    f"({mean_blocks:.1f} on average, under {AUTO_MIN_BLOCKS_D64})")
    return None


class HopperForwardKernel(HopperFamily):
    """The Hopper forward of one pair of traced mods: one compiled source per lowering variant, one
    launch plan per problem (see [Note] Cache keys in kernels/family.py)."""

    kind = "hopper_forward"

    def unsupported_reason(self, q, k, v, block_mask, need_max: bool) -> Optional[str]:
        """Why this call cannot run here (None: it can): the problem's reason, or the mods'."""
        return self.problem_reason(q, k, v, block_mask, need_max) or self.failed_reason(q, k)

    @staticmethod
    def problem_reason(q, k, v, block_mask, need_max: bool) -> Optional[str]:
        """The part of ``unsupported_reason`` that the mods' kernels do not change: the device, the
        tensors' dtypes, shapes, strides and alignment, BLOCK_SIZE and need_max
        (common.problem_reason). dispatch.py keeps it per key of those facts."""
        return problem_reason(q, k, v, block_mask, need_max)

    def __call__(self, q, k, v, block_mask, scale: float, score_captured, mask_captured, *, need_lse: bool):
        """``(out, lse or None)``; raises HopperUnavailable when the kernel of these mods does not compile
        (checked by the caller with ``unsupported_reason`` first, for everything else)."""
        global launches
        problem = Problem(q, k, v, block_mask, launch_tables(block_mask), scale, score_captured, mask_captured, {},
                          need_lse)
        key = self._problem(q, k, v, problem.tables, scale, need_lse, self._consumers(q, block_mask))
        if self._prepared:
            result = self._prepared_result(key, problem)
            if result is not None:
                return result
        plan = self._plans.get(key)
        if plan is None:
            plan, result = self._first_launch(key, problem)
        else:
            result = self._launch(plan, problem)
        if not recording():
            launches += 1
            self.last_plan = plan
            if self._plans.get(key) is plan:  # kept: its launch compiled ([Note] Prepared Gluon forward launches)
                walks = program_walks(block_mask) if plan.steps["forward"].constexprs["UNION_WALK"] else None
                self._keep_prepared(key, PreparedHopperForward(self, plan, problem, walks))
        return result

    @staticmethod
    def _problem(q, k, v, tables, scale, need_lse, consumers: int) -> tuple:
        return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
                tables.plan_key, need_lse, scale > 0, consumers)

    def _consumers(self, q, block_mask) -> int:
        """Consumer warpgroups a program of this call has ([Note] Three consumers on an unmasked walk,
        [Note] Programs across query blocks)."""
        E = q.shape[-1]
        if not THREE_CONSUMERS.get(E, False) or block_mask.seq_lengths[1] < THREE_CONSUMERS_MIN_KEY_BLOCKS * BLOCK:
            return 2
        if not self.has_mask_mod:
            return 3 if block_mask.peek_derived(EVERY_BLOCK_FULL) else 2
        if not UNION_WALKS.get(E, False) or block_mask.serves_one_call:
            return 2
        if block_mask.seq_lengths[0] != q.shape[2]:
            return 2  # the walks clamp the last program's rows to the mask's Q_LEN, the kernel to the query's
        if launch_tables(block_mask).stats.mean_blocks < THREE_CONSUMERS_MIN_KEY_BLOCKS:
            return 2  # short walks: the union's extra tiles weigh more (sliding window, documents)
        if capturing(q):
            return 2  # a replay would read walks derived before the capture, whatever the tables hold then
        return 3

    def kept_plan(self, q, k, v, block_mask, scale: float, *, need_lse: bool) -> Optional[Plan]:
        """The plan of this problem once its first launch compiled (None before): for a caller that
        launches it again through ``warm_launch`` (compile/warm.py, [Note] Warm calls of the forward op)."""
        consumers = self._consumers(q, block_mask)
        return self._plans.get(self._problem(q, k, v, launch_tables(block_mask), scale, need_lse, consumers))

    def warm_launch(self, plan: Plan, q, k, v, block_mask, scale: float, *, need_lse: bool) -> "WarmHopperForward":
        """``plan`` (from kept_plan) for the later calls of this call's problem, which the caller keys
        (compile/warm.py, [Note] Warm calls of the forward op). Call it as ``(q, k, v, tables,
        score_captured, mask_captured, walks=...)``: a plan of union walks takes the walks of the
        call's tables (of the shape this call's have), any other none."""
        walks = program_walks(block_mask) if plan.steps["forward"].constexprs["UNION_WALK"] else None
        return WarmHopperForward(self, plan, q, k, v, launch_tables(block_mask), walks, scale, need_lse)

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        q, k, tables, scale, need_lse = problem.q, problem.k, problem.tables, problem.scale, problem.need_lse
        consumers = self._consumers(q, problem.block_mask)
        B, Hq, L, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        constexprs = dict(
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1], GQA_GROUP=Hq // Hkv,
            HEAD_DIM=E, SPARSE_Q_BLOCK_SIZE=BLOCK, SPARSE_KV_BLOCK_SIZE=BLOCK, BLOCK_M=64 * consumers, BLOCK_N=BLOCK,
            STAGES=STAGES[E], CONSUMERS=consumers,
            CONSUMER_REGS=CONSUMER_REGS if consumers == 2 else THREE_CONSUMER_REGS,
            TAKE_TURNS=consumers == 3, UNION_WALK=consumers == 3 and self.has_mask_mod,
            HAS_SCORE_MOD=self.has_score_mod,
            # The mods see the scaled score; the scale folds into the exp2 only when it is positive.
            SCALE_FIRST=self.has_score_mod or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.has_mask_mod, HAS_FULL_BLOCKS=tables.has_full,
            OUTPUT_LSE=need_lse, RESIDENT_IN_REGISTERS=consumers == 2 and resident_in_registers("forward", E),
            num_warps=4,  # the default partition: consumer warpgroup 0
        )
        HOPPER_FORWARD.check_constexprs(constexprs)
        grid = (-(-L // (64 * consumers)), Hq, B)
        return Plan(compiled, {"forward": Step(HOPPER_FORWARD, grid, constexprs)}, (L, S),
                    q.element_size())

    def _launch(self, plan: Plan, problem: Problem):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        q, k, v, tables = problem.q, problem.k, problem.v, problem.tables
        scale, need_lse = problem.scale, problem.need_lse
        B, Hq, L, E = q.shape
        step = plan.steps["forward"]
        # The program walks of a UNION_WALK launch ([Note] Programs across query blocks), else None.
        walks = program_walks(problem.block_mask) if step.constexprs["UNION_WALK"] else None
        out = empty_attention_output(q, E)
        lse = empty_output((B, Hq, L), torch.float32, q.device) if need_lse else out
        recipes, fixed = _problem_args(step, q, k, v, out, tables, walks, scale)
        descriptors = [TensorDescriptor(t, *recipe) for t, recipe in zip((q, k, v, out), recipes)]
        args = _pack(self, descriptors, lse, tables, walks, problem.score_captured, problem.mask_captured, fixed)
        launch(plan.compiled.kernel(HOPPER_FORWARD), step.grid, args, step.constexprs)
        return out, (lse if need_lse else None)


class WarmHopperForward:
    """HopperForwardKernel._launch of one problem's plan, for its later calls ([Note] Ready launches in
    kernels/launch.py): the output's strides, the 2-D views, the launch's ints and the launch order
    are worked out once from the first call; each call allocates, fills in its tensors and
    launches. ``(out, lse or None, None)``: the Gluon forward keeps no row maxima."""

    def __init__(self, family: HopperForwardKernel, plan: Plan, q, k, v, tables, walks, scale: float,
                 need_lse: bool):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        B, Hq, L, E = q.shape
        step = plan.steps["forward"]
        self.family, self.plan = family, plan
        self.launch = RepeatedLaunch(plan.compiled.kernel(HOPPER_FORWARD), step.grid, step.constexprs)
        self.need_lse = need_lse
        sample = empty_attention_output(q, E)  # the output's layout, and its descriptor's shape
        self.out_shape, self.out_strides, self.stats_shape = tuple(sample.shape), sample.stride(), (B, Hq, L)
        self.recipes, self.fixed = _problem_args(step, q, k, v, sample, tables, walks, scale)
        # The walks' shape the launch's ints were worked out for (None: a launch without walks).
        self.walks_shape = None if walks is None else tuple(walks.entries.shape)
        # Descriptors without the tensors: nothing of this call's is kept.
        self.templates = [descriptor_template(TensorDescriptor(t, *recipe))
                          for t, recipe in zip((q, k, v, sample), self.recipes)]
        # Whether every descriptor is copied from its template (not `None in templates`: the
        # descriptors' dataclass __eq__ would run at every call).
        self.copied = all(t is not None for t in self.templates)

    @property
    def takes_walks(self) -> bool:
        """Whether each call must pass the program walks of its tables (a plan of union walks)."""
        return self.walks_shape is not None

    def __call__(self, q, k, v, tables, score_captured, mask_captured, walks=None):
        """``(out, lse or None, None)``; None (nothing launched) when ``walks`` is missing or of
        another shape than the first call's."""
        global launches
        if (None if walks is None else tuple(walks.entries.shape)) != self.walks_shape:
            return None
        device = q.device
        out = empty_strided_output(self.out_shape, self.out_strides, q.dtype, device)
        lse = empty_output(self.stats_shape, torch.float32, device) if self.need_lse else out
        family = self.family
        if not self.copied or out.data_ptr() & 15:  # built and checked, as the long way does
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            d_q, d_k, d_v, d_out = (TensorDescriptor(t, *recipe) for t, recipe in zip((q, k, v, out), self.recipes))
        else:  # spelled out: a generator's resumptions are Python calls too
            t_q, t_k, t_v, t_out = self.templates
            d_q, d_k, d_v, d_out = (descriptor_over(t_q, q), descriptor_over(t_k, k), descriptor_over(t_v, v),
                                    descriptor_over(t_out, out))
        args = _pack(family, (d_q, d_k, d_v, d_out), lse, tables, walks, score_captured, mask_captured, self.fixed)
        self.launch(args, fresh_aligned=not (out.data_ptr() | lse.data_ptr()) & 15)
        launches += 1
        family.last_plan = self.plan
        return out, (lse if self.need_lse else None), None


# [Note] Prepared Gluon forward launches. The Gluon forward's eager calls take a prepared launch
# as the portable families' do ([Note] Prepared eager launches in kernels/family.py): after a call
# whose plan is kept (its kernel compiled), the family keeps, per plan key, the compiled op's warm
# launch of that plan (WarmHopperForward: the output's layout, the 2-D views, the launch's ints and
# launch order, descriptor templates without their tensors). The key (_problem) holds the shapes,
# strides, dtypes, device, the tables' plan key (row table's shape, full blocks, row statistics: so
# the launch order), need_lse, the scale's sign and the consumers (which read the mask, the lengths
# and whether a capture is on, every call). What it leaves out, checked at each call:
# - the plan itself, the scale's value and the sign of a zero, kernels compiled ahead (PreparedLaunch.serves);
# - the index tables' widths (IDX_COLS, FULL_IDX_COLS);
# - the 16-byte alignment of q, k and v, which their descriptors need: the long way checks it when it
#   builds them (dispatch asks it before any call, hopper/common.py shape_reason); an unaligned call
#   takes the long way, which raises as before. The output is a fresh allocation: an unaligned one
#   (no allocator gives it) gets descriptors built and checked;
# - the program walks of a UNION_WALK plan: each call's own (program_walks of its mask), of the shape
#   the launch's ints were worked out for, else the long way.
# The tables, the walks and the mods' tensors and numbers are the call's own, and every launch reads
# Triton's specialisation facts from its own arguments (_EveryCallLaunch). Nothing of a call's
# tensors is kept. tests/test_warm_gluon.py changes each of these.


class _EveryCallLaunch(NamedTuple):
    """``launch`` of one kernel, grid and constexprs, the specialisation facts read from each call's
    arguments (a RepeatedLaunch keeps the first call's; an eager call's key does not fix them)."""

    jit_fn: object
    grid: tuple
    constexprs: dict

    def __call__(self, args: tuple, fresh_aligned: bool):
        return launch(self.jit_fn, self.grid, args, self.constexprs)


class PreparedHopperForward(WarmHopperForward, PreparedLaunch):
    """WarmHopperForward for the eager calls of one plan key ([Note] Prepared Gluon forward launches)."""

    def __init__(self, family: HopperForwardKernel, plan: Plan, problem: Problem, walks):
        super().__init__(family, plan, problem.q, problem.k, problem.v, problem.tables, walks, problem.scale,
                         problem.need_lse)
        step = plan.steps["forward"]
        self.launch = _EveryCallLaunch(plan.compiled.kernel(HOPPER_FORWARD), step.grid, step.constexprs)
        self.scale = problem.scale
        self.widths = (problem.tables.kv_indices.shape[3], problem.tables.full_kv_indices.shape[3])

    def also_serves(self, problem: Problem) -> bool:
        tables = problem.tables
        if (tables.kv_indices.shape[3], tables.full_kv_indices.shape[3]) != self.widths:
            return False
        return not (problem.q.data_ptr() | problem.k.data_ptr() | problem.v.data_ptr()) & 15

    def run(self, problem: Problem):
        """``(out, lse or None)``; None (nothing launched) for walks of another shape."""
        walks = program_walks(problem.block_mask) if self.walks_shape is not None else None
        result = self(problem.q, problem.k, problem.v, problem.tables, problem.score_captured,
                      problem.mask_captured, walks=walks)
        return None if result is None else result[:2]


def _problem_args(step: Step, q, k, v, out, tables, walks, scale: float) -> tuple[list, dict]:
    """``(recipes, fixed)``: the arguments of Q's, K's, V's and the output's descriptors after their
    tensor (2-D shape, strides, block, layout), and the launch's ints and floats. The same for every
    call of one problem, so a warm launch works them out once."""
    B, Hq, L, E = q.shape
    k_strides, v_strides = kv_strides(k, v, B)
    half, tile = shared_layout(64, E, q.dtype), shared_layout(BLOCK, E, q.dtype)
    views, recipes = [], []
    for t, strides, rows, layout in ((q, q.stride(), 64, half), (k, k_strides, BLOCK, tile),
                                     (v, v_strides, BLOCK, tile), (out, out.stride(), 64, half)):
        view = tensor_view(t, strides)
        views.append(view)
        recipes.append((list(view.shape), [view.row_stride, 1], [rows, E], layout))
    qv, kv, vv, ov = views
    fixed = dict(
        row_qz=qv.row_z, row_qh=qv.row_h, col_qh=qv.col_h, row_kz=kv.row_z, row_kh=kv.row_h, col_kh=kv.col_h,
        row_vz=vv.row_z, row_vh=vv.row_h, col_vh=vv.col_h, row_oz=ov.row_z, row_oh=ov.row_h, col_oh=ov.col_h,
        SPARSE_ROWS=tables.kv_num_blocks.shape[2], IDX_COLS=tables.kv_indices.shape[3],
        FULL_IDX_COLS=tables.full_kv_indices.shape[3], Q_LEN=L, SM_SCALE=scale,
        WALK_ROWS=0 if walks is None else walks.entries.shape[2],
        WALK_COLS=0 if walks is None else walks.entries.shape[3],
        TAIL_PAIRS=tail_pairs(step.grid, q.device, rows_alike(tables, k.shape[2], BLOCK)),
    )
    return recipes, fixed


def _pack(family: HopperForwardKernel, descriptors, lse, tables, walks, score_captured, mask_captured,
          fixed: dict) -> tuple:
    """The Gluon forward's arguments: the four descriptors, the LSE buffer, the tables and the program
    walks (None: the tables stand in), the mods' tensors, and ``fixed`` (_problem_args)."""
    d_q, d_k, d_v, d_out = descriptors
    return HOPPER_FORWARD.pack(
        Q=d_q, K=d_k, V=d_v, OUT=d_out, LSE=lse,
        KV_NUM_BLKS=tables.kv_num_blocks, KV_IDX=tables.kv_indices, FULL_KV_NUM_BLKS=tables.full_kv_num_blocks,
        FULL_KV_IDX=tables.full_kv_indices,
        WALK_NUM=tables.kv_num_blocks if walks is None else walks.num,
        WALK=tables.kv_indices if walks is None else walks.entries,
        mods=mod_launch_args(score_captured if family.has_score_mod else (),
                             mask_captured if family.has_mask_mod else ()),
        **fixed,
    )


_kernels: "OrderedDict[tuple, HopperForwardKernel]" = OrderedDict()  # see [Note] Cache keys in kernels/family.py


def hopper_forward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *,
                        tanh_approx: bool = False) -> HopperForwardKernel:
    """The Hopper forward for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, HopperForwardKernel, score, mask, tanh_approx)
