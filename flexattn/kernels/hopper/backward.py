"""The Hopper backward family: a dK/dV and a dQ kernel in Gluon per pair of traced mods
(templates/hopper_backward.py.jinja), after the portable backward's preprocess (DELTA), and their
launches.

Warp-specialised like the Hopper forward (forward.py): a loader warp feeds two consumer
warpgroups through an mbarrier ring. dK/dV walks the BlockMask's transposed tables and dQ its
forward tables, the same tables the portable backward walks (kernels/tables.py), with the same
lowered mods and the score_mod's lowered gradient. The dK/dV kernel also adds dQ into a float32
buffer, and no dQ kernel runs ([Note] dQ in the dK/dV kernel). A deterministic call adds dQ there in
a fixed order ([Note] Ordered dQ additions in the template) where the mask's rows visit every key
block; otherwise the dQ kernel runs and each output row is written by one program, no atomics. Either
way the result does not depend on scheduling (bit-identical from run to run; ``dq_form`` decides).

It covers the common case; :func:`problem_reason` and ``HopperBackwardKernel.unsupported_reason`` say
why a call is outside it (learnable captured tensors, a broadcast key/value batch, context
parallelism's float32 parts, anything the forward's reasons name), and dispatch.py then runs the
portable backward, or raises when ``BACKEND='GLUON'`` pinned this one.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import replace
from typing import Optional

import torch

from ...codegen import KernelSpec
from ...codegen.params import BACKWARD_PREPROCESS, HOPPER_BACKWARD_DKDV, HOPPER_BACKWARD_DQ
from ...lowering import index_bounds, lower_score_grad
from ...masks.layout import cdiv
from ...trace import TracedMod
from ..ahead import recording
from ..backward import preprocess_delta, preprocess_launch
from ..family import CompiledKernel, Plan, Problem, Step, cached_kernel
from ..launch import (RepeatedLaunch, descriptor_over, descriptor_template, empty_output, kv_strides, launch,
                      mod_launch_args, zeroed_output)
from ..launch_order import rows_alike, sm_count, tail_pairs
from ..tables import backward_tables, dq_turns, launch_tables
from .common import BLOCK, CONSUMER_REGS, HopperFamily, resident_in_registers, shared_layout, tensor_view
from .common import problem_reason as common_problem_reason

__all__ = ["HopperBackwardKernel", "WarmHopperBackward", "hopper_backward_kernel", "problem_reason", "dq_form",
           "launches"]

launches = 0  # backward calls run by this family (tests check the Gluon path really ran)
# dK/dV walks each listed 128-row query block as two tiles of 64 rows. Tiles of 128 rows, as
# FlashAttention-3 has at head dim 64, were slower on all seven paper cases at d=64
# (docs/benchmarks_log.md, "The d=64 backward: dQ in the dK/dV kernel for every call ..."): a thread
# then holds 32 LSE and 32 DELTA values beside S^T and dP^T (64 registers each), and the fused form
# spilled.
QUERY_TILE = 64
# Ring depths: dK/dV holds K and V (128 rows) and STAGES slots of Q and dO (64 rows); dQ holds Q and
# dO (128 rows) and STAGES slots of K and V (128 rows). Both fit in 228 KB with these depths.
# At d=64 an even depth of the dK/dV ring was faster than an odd one on every causal-like mask, and
# 4 was the best or level with it (docs/benchmarks_log.md, "Even ring depths in the Hopper kernels ...").
DKDV_STAGES = {64: 4, 128: 2}
DQ_STAGES = {64: 4, 128: 2}
PREPROCESS_ROWS = 64
# [Note] dQ in the dK/dV kernel. FlashAttention-3's backward forms dQ's part of each (key block,
# query tile) pair where dS is formed, in the dK/dV kernel, and has the copy engine add it into a
# float32 buffer (cp.reduce.async.bulk.tensor .add): five matrix products a pair instead of seven,
# since a separate dQ kernel must form S and dP (and run the mods) again. Here the two consumers
# publish their halves of the tile's dS^T in shared memory, then:
# - head dim 64: they take turns (even tiles consumer 0, odd tiles consumer 1) multiplying the whole
#   of it by K and adding the 64-row result: one reduce a tile, not one per consumer, which halves
#   the float32 traffic into L2;
# - head dim 128: each consumer multiplies all of it by its 64 of K's columns, on the tensor cores
#   beside dK's product, and adds a 64 x 64 tile. A whole 64 x 128 dQ tile in one consumer, on top of
#   dK and dV's 128 registers a thread, spilled (the turns' form there was slower under a causal mask,
#   and took more shared memory than this form). dQ's product is issued before dK's, so that its
#   tile goes to shared memory and the copy engine while dK's runs: level or faster on the paper
#   cases; the same order in the turns at d=64 gained nothing and was not kept.
# Measured against the two kernels (docs/benchmarks_log.md, "Hopper backward: dQ in the dK/dV kernel
# (issue 22, 2026-11-26, third session)", "Hopper backward: dQ in the dK/dV kernel at head dim 128,
# and one loop of tiles ...", "The d=64 backward: dQ in the dK/dV kernel for every call ..." and "The
# one-loop backward under Triton 3.7 to 3.9 ..."):
# - turns, d=64: faster without mods, and more so with a score_mod (the dQ kernel ran the score_mod
#   and its gradient again); with a mask_mod alone about level, and a causal 12-layer model trained
#   slower (the dK/dV programs' uneven work under a causal mask grows with the dQ products); level
#   or faster once [Note] Launch order evened out the dK/dV programs;
# - columns, d=128: faster without mods and with a score_mod, level or faster with a mask_mod;
# - the consumers walk a program's tiles in one loop here, the mask_mod behind a flag, where the
#   two-kernel form keeps a loop for partial blocks and one for full ones. With the two loops this
#   kernel was slower with a mask_mod at d=128: ptxas (Triton 3.6) spilled 12 values every tile
#   of the full loop. With one loop it spills none in the tiles, and at d=64 it was level or
#   faster. The two-kernel form keeps its two loops (one loop gained nothing there). A first
#   one-loop form, calling the tile once for each kind of block, gave wrong gradients under Triton
#   3.6 with a mask_mod (not investigated; the GPU tests' comparisons with float64 catch such a form);
# - one reduce per consumer of its 64 keys' part: slower at both head dims: the doubled traffic
#   costs more than the products saved.
# - a mask_mod alone at d=64 with one loop: too uneven to move the rule at first; once K and V
#   stayed in registers ([Note] Resident tiles in registers in kernels/hopper/common.py), level or
#   faster on every mask, the causal 12-layer model level. So the rule went.
# The one loop and the d=128 form passed the GPU tests under Triton 3.6 to 3.9 at the same speed.
# So dQ joins the dK/dV kernel at head dims 64 and 128, whatever the mods. The order of the
# additions depends on scheduling, so those sums are not bit-identical from run to run: a
# deterministic call (options.deterministic) adds them in a fixed order or keeps the two kernels,
# whose every output row has one writer (ORDERS_DQ below).


# Which deterministic calls add dQ in the dK/dV kernel, in a fixed order ([Note] Ordered dQ additions
# in templates/hopper_backward.py.jinja), rather than run the two kernels: "rows alike" (every row of
# the mask visits every key block, as without a mask_mod), "always" or "never" (the tests pin both
# forms). Either way every program of a (batch, head) pair must fit on the GPU at once.
# Against the default, the ordered form costs less than the two kernels where every row visits every
# key block, and far more under causal-like masks (docs/benchmarks_log.md, "A deterministic backward
# with dQ in the dK/dV kernel, in a fixed order ...").
# Under a causal-like mask the programs of a pair start apart (the short walks end first and the
# next pair's programs take their place), so a fixed order makes the early ones wait for late ones.
ORDERS_DQ = "rows alike"


def dq_form(q: torch.Tensor, k: torch.Tensor, deterministic: bool, rows_alike: bool) -> tuple[bool, bool]:
    """``(fused, ordered)``: whether dQ is added in the dK/dV kernel ([Note] dQ in the dK/dV kernel)
    rather than by its own, and in a fixed order ([Note] Ordered dQ additions); ``rows_alike``: every
    row of the mask visits every key block (launch_order.rows_alike)."""
    if q.shape[-1] not in (64, 128):
        return False, False
    if not deterministic:
        return True, False
    ordered = ORDERS_DQ == "always" or (ORDERS_DQ == "rows alike" and rows_alike)
    ordered = ordered and (not q.is_cuda or k.shape[2] // BLOCK <= sm_count(q.device))
    return ordered, ordered


def _dq_form(problem: Problem) -> tuple[bool, bool]:
    """dq_form of one call of the family."""
    q, k = problem.q, problem.k
    return dq_form(q, k, problem.deterministic, rows_alike(problem.tables, k.shape[2], BLOCK))


# [Note] The float32 dQ tile in shared memory. A consumer stores its 64 x 64 float32 tile from the
# products' register layout, then the copy engine adds it into DQ_ACC. Unswizzled, rows of 256 bytes
# put the 8 rows of one store instruction in the same 8 banks: 8 passes where 2 would do, 512
# shared-memory cycles a tile against 128. Under the 128-byte swizzle the stores use every bank,
# but the copy engine's box is then 128 bytes wide: each tile leaves as two boxes of 32 columns
# (Triton 3.6's lowering of the reduce does not split a wider box itself, as it does for loads: it
# would add only the first 32 columns). Faster than the unswizzled tile on every case measured, at
# both head dims (docs/benchmarks_log.md, "The float32 dQ tile's bank conflicts in the Gluon backward ...").
DQ_BOX_COLUMNS = 32


@functools.lru_cache(maxsize=None)
def _dq_acc_layout():
    """The shared layout of the float32 dQ tiles (built on first use: Gluon's layouts need Triton)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=4 * DQ_BOX_COLUMNS, element_bitwidth=32, rank=2)


def problem_reason(q, k, v, block_mask, float32_kv_grads: bool = False,
                   grad_out: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the Hopper backward cannot run this problem (None: it can), whatever the mods. ``grad_out``
    (the output's gradient, when known) is read through a tensor descriptor like q."""
    reason = common_problem_reason(q, k, v, block_mask, need_max=False)
    if reason is not None:
        return reason
    if grad_out is not None:
        view = tensor_view(grad_out, grad_out.stride())
        if (view is None or grad_out.data_ptr() % 16 or (view.row_stride * grad_out.element_size()) % 16
                or grad_out.dtype != q.dtype):
            return ("the output's gradient cannot be read through one 2-D tensor descriptor (it needs q's dtype, "
                    "16-byte aligned rows and base)")
    if k.shape[0] != q.shape[0]:
        return "the Gluon backward needs a key/value batch equal to the queries' (no broadcast batch of 1)"
    if float32_kv_grads:
        return "the Gluon backward writes dK and dV in the inputs' dtype, not as float32 parts"
    if q.shape[0] * q.shape[1] * q.shape[2] >= 2**31:
        return "the Gluon backward indexes rows in 32 bits: batch x heads x length must stay under 2**31"
    return None


class HopperBackwardKernel(HopperFamily):
    """The Hopper backward of one pair of traced mods: one compiled source per lowering variant, one
    launch plan per problem (see [Note] Cache keys in kernels/family.py)."""

    kind = "hopper_backward"
    what = "backward"

    def _spec(self, variants: tuple) -> KernelSpec:
        score_grad = None
        if self.score is not None:
            score_grad = lower_score_grad(self.score, prefix="sm_", tanh_approx=self.tanh_approx, variant=variants[0])
        return replace(super()._spec(variants), score_grad=score_grad)

    def unsupported_reason(self, q, k, v, block_mask, float32_kv_grads: bool = False,
                           grad_out: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why this call cannot run here (None: it can): the problem's reason, or the mods'."""
        return (self.problem_reason(q, k, v, block_mask, float32_kv_grads, grad_out) or self.failed_reason(q, k)
                or self.trainable_reason(q, k))

    @staticmethod
    def problem_reason(q, k, v, block_mask, float32_kv_grads: bool = False,
                       grad_out: Optional[torch.Tensor] = None) -> Optional[str]:
        """The part of ``unsupported_reason`` that the mods do not change (the module's problem_reason):
        the device, the tensors' dtypes, shapes, strides and alignment, BLOCK_SIZE, float32_kv_grads.
        dispatch.py keeps it per key of those facts."""
        return problem_reason(q, k, v, block_mask, float32_kv_grads, grad_out)

    def trainable_reason(self, q, k) -> Optional[str]:
        """Why the mods send this call to the portable backward (None: they do not): learnable
        captured tensors, whose gradients the Gluon kernels do not write. The same for every call of
        the mods at these lengths (the kernels compiled for them say it)."""
        B, Hq, L, _ = q.shape
        if self.compiled(index_bounds(B, Hq, L, k.shape[2])).trainable:
            return ("the score_mod's captured tensors that require grad (learnable biases) get their gradients "
                    "from the portable backward")
        return None

    def __call__(self, q, k, v, out, lse, grad_out, grad_lse, block_mask, scale: float, score_captured,
                 mask_captured, deterministic: bool = False):
        """``(dq, dk, dv, [None for each captured tensor])``; raises HopperUnavailable when the kernels of
        these mods do not compile (the caller checked ``unsupported_reason`` first, for everything else).
        ``deterministic``: sums formed in the same order at every run (``dq_form`` says how: dQ added in
        the dK/dV kernel in a fixed order, or the two kernels, whose every output row has one writer)."""
        global launches
        problem = Problem(q, k, v, block_mask, launch_tables(block_mask), scale, score_captured, mask_captured, {},
                          out=out, lse=lse, grad_out=grad_out, grad_lse=grad_lse, deterministic=deterministic)
        fused_dq, ordered_dq = _dq_form(problem)
        key = self._problem(q, k, v, out, grad_out, grad_lse, problem.tables, scale, fused_dq, ordered_dq)
        plan = self._plans.get(key)
        if plan is None:
            plan, result = self._first_launch(key, problem)
        else:
            result = self._launch(plan, problem)
        if not recording():
            launches += 1
            self.last_plan = plan
        return result

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        q, k, tables, scale = problem.q, problem.k, problem.tables, problem.scale
        fused_dq, ordered_dq = _dq_form(problem)
        B, Hq, L, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        common = dict(
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1], GQA_GROUP=Hq // Hkv,
            HEAD_DIM=E, SPARSE_Q_BLOCK_SIZE=BLOCK, SPARSE_KV_BLOCK_SIZE=BLOCK, CONSUMER_REGS=CONSUMER_REGS,
            HAS_SCORE_MOD=self.has_score_mod,
            # The mods see the scaled score; the scale folds into the exp2 only when it is positive.
            SCALE_FIRST=self.has_score_mod or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.has_mask_mod, HAS_FULL_BLOCKS=tables.has_full,
            num_warps=4,  # the default partition: consumer warpgroup 0
        )
        dkdv = dict(common, BLOCK_M=QUERY_TILE, BLOCK_N=BLOCK, STAGES=DKDV_STAGES[E], FUSED_DQ=fused_dq,
                    ORDERED_DQ=ordered_dq, RESIDENT_IN_REGISTERS=resident_in_registers("dkdv", E))
        dq = dict(common, BLOCK_M=BLOCK, BLOCK_N=BLOCK, STAGES=DQ_STAGES[E])
        HOPPER_BACKWARD_DKDV.check_constexprs(dkdv)
        HOPPER_BACKWARD_DQ.check_constexprs(dq)
        preprocess = dict(V_HEAD_DIM=E, V_HEAD_DIM_P2=E, BLOCK_M=PREPROCESS_ROWS, HAS_DLSE=problem.grad_lse is not None)
        steps = {
            "preprocess": Step(BACKWARD_PREPROCESS, (cdiv(L, PREPROCESS_ROWS), Hq, B), preprocess),
            "dkdv": Step(HOPPER_BACKWARD_DKDV, (S // BLOCK, Hkv, B), dkdv),
        }
        if not fused_dq:
            steps["dq"] = Step(HOPPER_BACKWARD_DQ, (L // BLOCK, Hq, B), dq)
        return Plan(compiled, steps, (L, S), q.element_size())

    def _problem(self, q, k, v, out, grad_out, grad_lse, tables, scale, fused_dq: bool, ordered_dq: bool) -> tuple:
        return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), grad_out.stride(), out.stride(),
                q.dtype, q.device, tables.plan_key, scale > 0, grad_lse is not None, fused_dq, ordered_dq)

    def kept_plan(self, q, k, v, out, grad_out, grad_lse, block_mask, scale: float, deterministic: bool) -> Optional[Plan]:
        """The plan of this problem once its first launch compiled (None before): for a caller that
        launches it again through ``warm_launch`` (compile/warm.py, [Note] Warm calls of the backward op).
        None for a deterministic call that adds dQ in order: its turns come from the mask, which a warm
        launch does not see."""
        tables = launch_tables(block_mask)
        fused_dq, ordered_dq = dq_form(q, k, deterministic, rows_alike(tables, k.shape[2], BLOCK))
        if ordered_dq:
            return None
        return self._plans.get(self._problem(q, k, v, out, grad_out, grad_lse, tables, scale, fused_dq, False))

    def warm_launch(self, plan: Plan, q, k, v, out, grad_out, tables, bwd_tables, scale: float) -> "WarmHopperBackward":
        """``plan`` (from kept_plan) for the later calls of this call's problem, which the caller keys.
        Call it as ``(q, k, v, out, lse, grad_out, grad_lse, tables, bwd_tables, score_captured,
        mask_captured) -> (dq, dk, dv)``."""
        return WarmHopperBackward(self, plan, q, k, v, grad_out, tables, bwd_tables, scale)

    def _launch(self, plan: Plan, problem: Problem):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        q, k, v, out, grad_out = problem.q, problem.k, problem.v, problem.out, problem.grad_out
        block_mask = problem.block_mask
        tables, scale, score_captured = problem.tables, problem.scale, problem.score_captured

        B, Hq, L, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        module = plan.compiled

        delta = preprocess_delta(module, plan.steps["preprocess"], out, grad_out, problem.grad_lse)
        lse = problem.lse.contiguous()
        fused_dq = "dq" not in plan.steps
        dk = empty_output((B, Hkv, S, E), k.dtype, q.device)
        dv = empty_output((B, Hkv, S, E), v.dtype, q.device)
        if fused_dq:  # float32 sums the dK/dV programs add into: rows (batch, query head, query)
            dq = zeroed_output((B * Hq * L, E), torch.float32, q.device)
        else:
            dq = empty_output((B, Hq, L, E), q.dtype, q.device)
        bwd = backward_tables(block_mask)
        ordered = plan.steps["dkdv"].constexprs["ORDERED_DQ"]
        turns = dq_turns(block_mask) if ordered else None
        recipes, dkdv_fixed, dq_fixed = _problem_args(plan, q, k, v, grad_out, dk, dv, dq, tables, bwd, scale)
        descriptors = [TensorDescriptor(t, *recipe) for t, recipe in zip((q, k, v, grad_out, dk, dv, dq), recipes)]
        mods = mod_launch_args(score_captured if self.has_score_mod else (),
                               problem.mask_captured if self.has_mask_mod else ())
        step = plan.steps["dkdv"]
        launch(module.kernel(HOPPER_BACKWARD_DKDV), step.grid,
               _pack_dkdv(descriptors, lse, delta, bwd, mods, dkdv_fixed, turns), step.constexprs)
        if fused_dq:
            return dq.view(B, Hq, L, E).to(q.dtype), dk, dv, [None] * len(score_captured)
        step = plan.steps["dq"]
        launch(module.kernel(HOPPER_BACKWARD_DQ), step.grid, _pack_dq(descriptors, lse, delta, tables, mods, dq_fixed),
               step.constexprs)
        return dq, dk, dv, [None] * len(score_captured)


class WarmHopperBackward:
    """HopperBackwardKernel._launch of one problem's plan, for its later calls ([Note] Ready launches
    in kernels/launch.py): the 2-D views, the launches' ints, the descriptors' shapes and the launch
    order worked out once from the first call; each call allocates, copies its seven descriptors
    from templates holding no tensor, and launches."""

    def __init__(self, family: HopperBackwardKernel, plan: Plan, q, k, v, grad_out, tables, bwd_tables, scale: float):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        B, Hq, L, E = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        module = plan.compiled
        self.family, self.plan = family, plan
        self.fused_dq = "dq" not in plan.steps
        self.preprocess = preprocess_launch(plan)
        step = plan.steps["dkdv"]
        self.dkdv = RepeatedLaunch(module.kernel(HOPPER_BACKWARD_DKDV), step.grid, step.constexprs)
        self.dq = None
        if not self.fused_dq:
            step = plan.steps["dq"]
            self.dq = RepeatedLaunch(module.kernel(HOPPER_BACKWARD_DQ), step.grid, step.constexprs)
        self.kv_shape = (B, Hkv, S, E)
        self.dq_shape = (B * Hq * L, E) if self.fused_dq else (B, Hq, L, E)
        # Samples of the outputs' layouts, for the descriptors' templates (nothing of them is kept).
        sample_kv = torch.empty(self.kv_shape, dtype=k.dtype, device=q.device)
        sample_dq = torch.empty(self.dq_shape, dtype=torch.float32 if self.fused_dq else q.dtype, device=q.device)
        self.recipes, self.dkdv_fixed, self.dq_fixed = _problem_args(plan, q, k, v, grad_out, sample_kv, sample_kv,
                                                                     sample_dq, tables, bwd_tables, scale)
        samples = (q, k, v, grad_out, sample_kv, sample_kv, sample_dq)
        self.templates = [descriptor_template(TensorDescriptor(t, *recipe)) for t, recipe in zip(samples, self.recipes)]
        # Not `None in templates` at each call: the descriptors' dataclass __eq__ would run for each.
        self.copied = all(t is not None for t in self.templates)

    def __call__(self, q, k, v, out, lse, grad_out, grad_lse, tables, bwd_tables, score_captured, mask_captured):
        global launches
        plan, family, device = self.plan, self.family, q.device
        delta = preprocess_delta(plan.compiled, plan.steps["preprocess"], out, grad_out, grad_lse, self.preprocess)
        lse = lse.contiguous()
        dk, dv = empty_output(self.kv_shape, k.dtype, device), empty_output(self.kv_shape, v.dtype, device)
        if self.fused_dq:
            dq = zeroed_output(self.dq_shape, torch.float32, device)
        else:
            dq = empty_output(self.dq_shape, q.dtype, device)
        tensors = (q, k, v, grad_out, dk, dv, dq)
        if not self.copied:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            descriptors = [TensorDescriptor(t, *recipe) for t, recipe in zip(tensors, self.recipes)]
        else:
            descriptors = [descriptor_over(d, t) for d, t in zip(self.templates, tensors)]
        mods = mod_launch_args(score_captured if family.has_score_mod else (),
                               mask_captured if family.has_mask_mod else ())
        fresh = not (delta.data_ptr() | lse.data_ptr()) & 15
        self.dkdv(_pack_dkdv(descriptors, lse, delta, bwd_tables, mods, self.dkdv_fixed), fresh)
        if self.dq is not None:
            self.dq(_pack_dq(descriptors, lse, delta, tables, mods, self.dq_fixed), fresh)
        launches += 1
        family.last_plan = plan
        if self.fused_dq:
            B, Hq, L, E = q.shape
            return dq.view(B, Hq, L, E).to(q.dtype), dk, dv
        return dq, dk, dv


def _problem_args(plan: Plan, q, k, v, grad_out, dk, dv, dq, tables, bwd_tables, scale: float) -> tuple:
    """``(recipes, dkdv_fixed, dq_fixed)``: the arguments of the seven descriptors after their tensor
    (Q, K, V, dO, dK, dV, and dQ or its float32 sums: 2-D shape, strides, block, layout) and each
    launch's ints and floats. The same for every call of one problem, so a warm launch works them
    out once ([Note] 2-D views in templates/hopper_forward.py.jinja)."""
    B, Hq, L, E = q.shape
    S = k.shape[2]
    k_strides, v_strides = kv_strides(k, v, B)
    half, tile = shared_layout(QUERY_TILE, E, q.dtype), shared_layout(BLOCK, E, q.dtype)
    views, recipes = [], []
    for t, strides, rows, layout in ((q, q.stride(), QUERY_TILE, half), (k, k_strides, BLOCK, tile),
                                     (v, v_strides, BLOCK, tile), (grad_out, grad_out.stride(), QUERY_TILE, half),
                                     (dk, dk.stride(), QUERY_TILE, half), (dv, dv.stride(), QUERY_TILE, half)):
        view = tensor_view(t, strides)
        views.append(view)
        recipes.append((list(view.shape), [view.row_stride, 1], [rows, E], layout))
    if "dq" in plan.steps:
        view = tensor_view(dq, dq.stride())
        recipes.append((list(view.shape), [view.row_stride, 1], [QUERY_TILE, E], half))
    else:  # the float32 sums, rows (batch, query head, query)
        recipes.append(([B * Hq * L, E], [E, 1], [QUERY_TILE, DQ_BOX_COLUMNS], _dq_acc_layout()))
    qv, kv, vv, dov, dkv, _ = views
    common = dict(row_qz=qv.row_z, row_qh=qv.row_h, col_qh=qv.col_h, row_kz=kv.row_z, row_kh=kv.row_h,
                  col_kh=kv.col_h, row_vz=vv.row_z, row_vh=vv.row_h, col_vh=vv.col_h, row_doz=dov.row_z,
                  row_doh=dov.row_h, col_doh=dov.col_h, Q_LEN=L, SM_SCALE=scale)
    alike = rows_alike(tables, S, BLOCK)
    grid = plan.steps["dkdv"].grid
    # Ordered dQ additions keep the grid's order: a pair's programs start one after another ([Note]
    # Ordered dQ additions).
    order = 1 if plan.steps["dkdv"].constexprs["ORDERED_DQ"] else tail_pairs(grid, q.device, alike)
    dkdv_fixed = dict(common, row_dkz=dkv.row_z, row_dkh=dkv.row_h, col_dkh=dkv.col_h,
                      SPARSE_COLS=bwd_tables.q_num_blocks.shape[2], IDX_ROWS=bwd_tables.q_indices.shape[3],
                      FULL_IDX_ROWS=bwd_tables.full_q_indices.shape[3], TAIL_PAIRS=order)
    dq_fixed = None
    if "dq" in plan.steps:
        dq_fixed = dict(common, SPARSE_ROWS=tables.kv_num_blocks.shape[2], IDX_COLS=tables.kv_indices.shape[3],
                        FULL_IDX_COLS=tables.full_kv_indices.shape[3],
                        TAIL_PAIRS=tail_pairs(plan.steps["dq"].grid, q.device, alike))
    return recipes, dkdv_fixed, dq_fixed


def _pack_dkdv(descriptors, lse, delta, bwd_tables, mods: list, fixed: dict, turns=None) -> tuple:
    """The dK/dV kernel's arguments: the descriptors (dQ's read only when dQ is fused), the row
    statistics, the transposed tables, the turns of ordered dQ additions (``turns``, tables.DqTurns,
    with a fresh count of additions; the index tables stand in, unread, without them), the mods'
    tensors, and ``fixed`` (_problem_args)."""
    d_q, d_k, d_v, d_do, d_dk, d_dv, d_dq = descriptors
    if turns is not None:
        # Per 64 query rows of every (batch, query head) and 64 columns of dQ (two at head dim 64, one used).
        added = torch.zeros(2 * lse.numel() // QUERY_TILE, dtype=torch.int32, device=lse.device)
        walk_first, q_turns, full_q_turns = turns
    else:
        added, walk_first = bwd_tables.q_num_blocks, bwd_tables.q_num_blocks
        q_turns, full_q_turns = bwd_tables.q_indices, bwd_tables.full_q_indices
    return HOPPER_BACKWARD_DKDV.pack(
        Q=d_q, K=d_k, V=d_v, DO=d_do, DK=d_dk, DV=d_dv, DQ_ACC=d_dq, LSE=lse, DELTA=delta,
        Q_NUM_BLKS=bwd_tables.q_num_blocks, Q_IDX=bwd_tables.q_indices, FULL_Q_NUM_BLKS=bwd_tables.full_q_num_blocks,
        FULL_Q_IDX=bwd_tables.full_q_indices, WALK_FIRST=walk_first, Q_TURNS=q_turns, FULL_Q_TURNS=full_q_turns,
        DQ_ADDED=added, mods=mods, **fixed,
    )


def _pack_dq(descriptors, lse, delta, tables, mods: list, fixed: dict) -> tuple:
    """The dQ kernel's arguments: the descriptors, the row statistics, the forward tables, the mods'
    tensors, and ``fixed`` (_problem_args)."""
    d_q, d_k, d_v, d_do, _, _, d_dq = descriptors
    return HOPPER_BACKWARD_DQ.pack(
        Q=d_q, K=d_k, V=d_v, DO=d_do, DQ=d_dq, LSE=lse, DELTA=delta, KV_NUM_BLKS=tables.kv_num_blocks,
        KV_IDX=tables.kv_indices, FULL_KV_NUM_BLKS=tables.full_kv_num_blocks, FULL_KV_IDX=tables.full_kv_indices,
        mods=mods, **fixed,
    )


_kernels: "OrderedDict[tuple, HopperBackwardKernel]" = OrderedDict()  # see [Note] Cache keys in kernels/family.py


def hopper_backward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *,
                         tanh_approx: bool = False) -> HopperBackwardKernel:
    """The Hopper backward for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, HopperBackwardKernel, score, mask, tanh_approx)
