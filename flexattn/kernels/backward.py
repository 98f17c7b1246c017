"""The backward kernel family: dQ, dK, dV and the gradients of captured tensors
(templates/backward.py.jinja), its launch plans and its launches.

A plan holds three steps:

1. ``"preprocess"``: DELTA = rowsum(dO * O) - dLSE, one program per query tile;
2. ``"dkdv"``: one program per key tile of one key/value head, walking the query blocks that see it
   through the BlockMask's transposed tables, summing over the query heads of its GQA group;
3. ``"dq"``: one program per query tile, walking the same key blocks as the forward.

Every output row is written by exactly one program, so there are no atomics on dQ, dK or dV and
the result does not depend on scheduling. Gradients of captured tensors (a learnable bias) are
added with float32 atomics by the dK/dV kernel only, at the addresses the mod read; in the
deterministic backward (``torch.use_deterministic_algorithms(True)`` or kernel option
``DETERMINISTIC``) each program adds into its own slot, in a fixed order, and the slots are summed
here (see [Note] Deterministic gradients in templates/backward.py.jinja).

The transposed tables are derived from the forward's checked tables (kernels/tables.py; never
taken from the mask's own ``q_indices``, which a hand-built mask could let disagree with
``kv_indices``): the backward walks exactly the blocks the forward walked.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..codegen import KernelSpec
from ..codegen.params import BACKWARD_DKDV, BACKWARD_DQ, BACKWARD_PREPROCESS
from ..errors import ResourceError
from ..lowering import index_bounds, lower_score_grad
from ..masks import BlockMask
from ..masks.layout import cdiv
from ..options import deterministic as requested_determinism
from ..trace import TracedMod
from .configs import (
    BACKWARD_TILE_KEYS, BackwardConfig, backward_pinned, backward_shared_memory_bytes, fit_backward,
    input_precision, max_shared_memory, next_pow2, pinned_backward_config, select_backward_config, tuned_configs,
    upcast_dots,
)
from .ahead import recording
from .family import (
    CompiledKernel, KernelFamily, Plan, PreparedLaunch, Problem, Step, TileRoles, cached_kernel, with_tiles,
)
from .launch import (
    RepeatedLaunch, empty_output, interpreter_enabled, kv_strides, launch, mod_launch_args,
)
from .launch_order import rows_alike, tail_pairs
from .tables import backward_tables, launch_tables
from .tma import install_tma_allocator, tma_compatible

__all__ = ["BackwardKernel", "WarmBackwardLaunch", "backward_kernel", "preprocess_delta", "preprocess_launch",
           "launches"]

launches = 0  # Triton backward calls in this process (tests check that the kernels, not a fallback, ran)

_BOTH_SIDES = ("QK_HEAD_DIM_P2", "V_HEAD_DIM_P2")


class BackwardKernel(KernelFamily):
    """The backward kernels of one pair of traced mods (see [Note] Cache keys in kernels/family.py):
    one compiled source per lowering variant, one launch plan per problem. ``compiled`` also lowers
    the score_mod's gradient, so a gradient that cannot be lowered raises (naming the op and the
    line) before any kernel runs."""

    kind = "backward"
    # dK/dV owns keys (K and V) and walks queries (Q and dO); dQ owns queries and walks keys.
    TILE_ROLES = {
        "dkdv": TileRoles(owned="BLOCK_N", owned_even="EVEN_N", owned_length=1, walked="BLOCK_M",
                          owned_width=_BOTH_SIDES, walked_width=_BOTH_SIDES),
        "dq": TileRoles(owned="BLOCK_M", owned_even="EVEN_M", owned_length=0, walked="BLOCK_N",
                        owned_width=_BOTH_SIDES, walked_width=_BOTH_SIDES),
    }

    def _spec(self, variants: tuple) -> KernelSpec:
        score_grad = None
        if self.score is not None:
            score_grad = lower_score_grad(self.score, prefix="sm_", tanh_approx=self.tanh_approx,
                                                   variant=variants[0])
        return replace(super()._spec(variants), score_grad=score_grad)

    def prepare(self, q, k, block_mask) -> None:
        """Lower and compile for this call's lengths now (at the forward), so a mod whose gradient
        cannot be lowered fails before any kernel runs."""
        B, Hq, L, _ = q.shape
        self.compiled(index_bounds(B, Hq, L, k.shape[2]))

    # ---------------------------------------------------------------- launch
    def __call__(self, q, k, v, out, lse, grad_out, grad_lse, block_mask: BlockMask, scale: float,
                 score_captured, mask_captured, options: dict, float32_kv_grads: bool = False):
        """``(dq, dk, dv, [gradient of each captured tensor or None])``. ``float32_kv_grads``: dk and
        dv come back in float32, unrounded, for a caller that sums several partial dK/dV of one key
        (context parallelism: rounding each part to bf16 would double the error)."""
        global launches
        deterministic = requested_determinism(options)
        problem = Problem(q, k, v, block_mask, launch_tables(block_mask), scale, score_captured, mask_captured,
                          options, out=out, lse=lse, grad_out=grad_out, grad_lse=grad_lse,
                          bwd_tables=backward_tables(block_mask), float32_kv_grads=float32_kv_grads,
                          deterministic=deterministic)
        key = _plan_key(problem)
        grads = self._prepared_result(key, problem)
        if grads is not None:
            return grads
        grads = self._run(key, problem)
        if not recording():
            launches += 1
            self._prepare(key, problem)
        return grads

    def _prepare(self, key: tuple, problem: Problem) -> None:
        """After a call of ``key`` ran its plan the long way: its launches, worked out for the next
        calls of the key ([Note] Prepared eager launches in kernels/family.py). Not for what
        WarmBackwardLaunch leaves out (gradients of captured tensors, a broadcast key/value batch)
        nor for float32 dK/dV."""
        q, k = problem.q, problem.k
        plan = self._plans.get(key)
        if (plan is None or plan.check_compiled or plan.compiled.trainable or k.shape[0] != q.shape[0]
                or problem.float32_kv_grads or self._for_call(plan, problem) is not plan):
            return
        self._keep_prepared(key, PreparedBackward(self, plan, problem))

    def kept_plan(self, q, k, v, out, grad_out, grad_lse, block_mask, scale: float, options: dict) -> Optional[Plan]:
        """The plan a call with these arguments launches now, once its problem's plan has settled, else
        None: for a caller that launches it again through ``warm_launch`` (compile/warm.py, [Note] Warm
        calls of the backward op). None too where a call does more than the three launches: gradients
        of captured tensors, a broadcast key/value batch."""
        if k.shape[0] != q.shape[0]:
            return None
        problem = Problem(q, k, v, block_mask, launch_tables(block_mask), scale, (), (), options, out=out,
                          grad_out=grad_out, grad_lse=grad_lse, deterministic=requested_determinism(options))
        plan = self._plans.get(_plan_key(problem))
        if plan is None or plan.check_compiled:
            return None
        if plan.compiled.trainable:
            return None
        return self._for_call(plan, problem)

    def warm_launch(self, plan: Plan, q, k, v, out, grad_out, tables, bwd_tables, scale: float) -> "WarmBackwardLaunch":
        """``plan`` (from kept_plan) for the later calls of this call's problem, which the caller keys.
        Call it as ``(q, k, v, out, lse, grad_out, grad_lse, tables, bwd_tables, score_captured,
        mask_captured) -> (dq, dk, dv)``."""
        return WarmBackwardLaunch(self, plan, q, k, v, out, grad_out, tables, bwd_tables, scale)

    def _for_call(self, plan: Plan, problem: Problem) -> Plan:
        """The plan this call runs: ``plan``, or, for an unaligned view of a problem whose plan reads
        through tensor descriptors (same shapes and strides as its first call), the plan without them."""
        if plan.constexprs("dkdv")["USE_TMA"] and (problem.q.data_ptr() | problem.k.data_ptr() | problem.v.data_ptr()
                                                   | problem.grad_out.data_ptr()) % 16:
            return plan.with_constexprs("dkdv", USE_TMA=False).with_constexprs("dq", USE_TMA=False)
        return plan

    def _launch(self, plan: Plan, problem: Problem):
        q, k, v, out, lse, grad_out = problem.q, problem.k, problem.v, problem.out, problem.lse, problem.grad_out
        tables, bwd_tables, score_captured = problem.tables, problem.bwd_tables, problem.score_captured
        B, Hq, L, E = q.shape
        Bk, Hkv, S, Ev = v.shape
        module = plan.compiled
        if plan.constexprs("dkdv")["USE_TMA"]:
            install_tma_allocator()  # this thread's: autograd runs the backward in a worker thread

        delta = preprocess_delta(module, plan.steps["preprocess"], out, grad_out, problem.grad_lse)

        # -- captured tensors and their gradient buffers ----
        trainable = plan.compiled.trainable
        dkdv = plan.steps["dkdv"]
        if plan.constexprs("dkdv")["DETERMINISTIC"] and trainable:
            stride = max(score_captured[i].numel() for i in trainable)  # one slot holds the largest
            slots = gradient_slots(math.prod(dkdv.grid), stride, q.device)
            grad_slots = [torch.zeros((slots, stride), dtype=torch.float32, device=q.device) for _ in trainable]
            grad_buffers = grad_slots
            turns = torch.zeros(slots, dtype=torch.int32, device=q.device)
        else:
            grad_slots, slots, stride = None, 1, 0
            grad_buffers = [torch.zeros(score_captured[i].shape, dtype=torch.float32, device=q.device)
                            for i in trainable]
            turns = delta  # not read
        mods = mod_launch_args(score_captured) + grad_buffers + mod_launch_args(problem.mask_captured)

        broadcast_kv = Bk == 1 and B > 1
        kv_grad_dtype = torch.float32 if problem.float32_kv_grads and k.dtype != torch.float64 else k.dtype
        if broadcast_kv:
            # Each query batch writes its own slice; the slices are summed below (float32).
            dk = empty_output((B, Hkv, S, E), torch.float32, q.device)
            dv = empty_output((B, Hkv, S, Ev), torch.float32, q.device)
        else:
            dk = empty_output(k.shape, kv_grad_dtype, q.device)
            dv = empty_output(v.shape, kv_grad_dtype, q.device)
        dq = empty_output(q.shape, q.dtype, q.device)
        lse = lse.contiguous()

        dkdv_fixed, dq_fixed = _problem_args(plan, q, k, v, grad_out, dk.stride(), dv.stride(), dq.stride(), tables,
                                             bwd_tables, problem.scale)
        dkdv_fixed.update(GRAD_SLOTS=slots, GRAD_SLOT_STRIDE=stride)
        dkdv_kernel = launch(module.kernel(BACKWARD_DKDV), dkdv.grid,
                             _pack_dkdv((q, k, v, grad_out), lse, delta, dk, dv, turns, bwd_tables, mods, dkdv_fixed),
                             dkdv.constexprs)
        dq_step = plan.steps["dq"]
        dq_kernel = launch(module.kernel(BACKWARD_DQ), dq_step.grid,
                           _pack_dq((q, k, v, grad_out), lse, delta, dq, tables, mods, dq_fixed), dq_step.constexprs)

        if broadcast_kv:
            dk = dk.sum(0, keepdim=True).to(kv_grad_dtype)
            dv = dv.sum(0, keepdim=True).to(kv_grad_dtype)
        if grad_slots is not None:  # summed in slot order, the same every run
            grad_buffers = [buf[:, :score_captured[i].numel()].sum(0).view(score_captured[i].shape)
                            for i, buf in zip(trainable, grad_slots)]
        captured_grads: list = [None] * len(score_captured)
        for i, buf in zip(trainable, grad_buffers):
            captured_grads[i] = buf.to(score_captured[i].dtype)
        return (dq, dk, dv, captured_grads), {"dkdv": dkdv_kernel, "dq": dq_kernel}

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        q, k, v, tables, scale, options = problem.q, problem.k, problem.v, problem.tables, problem.scale, problem.options
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        sparse_q, sparse_kv = problem.block_mask.BLOCK_SIZE
        cfg = select_backward_config(q.device, q.dtype, E, Ev, sparse_q, sparse_kv, self.mask is not None,
                                     tables.stats.mean_blocks)
        chosen_here = False
        if backward_pinned(options):
            cfg = pinned_backward_config(options, cfg, sparse_q, sparse_kv)
        elif options.get("AUTOTUNE") and not interpreter_enabled() and q.device.type == "cuda":
            cfg = self._tuned(problem, compiled, cfg)
        else:
            chosen_here = q.device.type == "cuda" and not interpreter_enabled()
        use_tma = bool(options.get("USE_TMA", cfg.USE_TMA)) and tma_compatible(q, k, v, problem.grad_out)
        dkdv_launch, dq_launch = cfg.dkdv(), cfg.dq()
        common = dict(
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1],
            GQA_GROUP=Hq // Hkv,
            QK_HEAD_DIM=E, QK_HEAD_DIM_P2=max(16, next_pow2(E)),
            V_HEAD_DIM=Ev, V_HEAD_DIM_P2=max(16, next_pow2(Ev)),
            SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
            HAS_SCORE_MOD=self.score is not None,
            SCALE_FIRST=self.score is not None or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.mask is not None, HAS_FULL_BLOCKS=tables.has_full,
            INPUT_PRECISION=input_precision(q.dtype),
            UPCAST_DOTS=upcast_dots(q.dtype),
            USE_TMA=use_tma, DETERMINISTIC=problem.deterministic,
        )
        # Each kernel checks bounds along its own tile (EVEN_* of its tile) and along the sparse
        # blocks it walks (whole blocks: EVEN_* of the BlockMask's block).
        dkdv = dict(common, BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1,
                    EVEN_M=L % sparse_q == 0, EVEN_N=S % cfg.BLOCK_N1 == 0, NUM_STAGES=dkdv_launch.num_stages,
                    num_warps=dkdv_launch.num_warps, num_stages=dkdv_launch.num_stages)
        dq = dict(common, BLOCK_M=cfg.BLOCK_M2, BLOCK_N=cfg.BLOCK_N2,
                  EVEN_M=L % cfg.BLOCK_M2 == 0, EVEN_N=S % sparse_kv == 0, NUM_STAGES=dq_launch.num_stages,
                  num_warps=dq_launch.num_warps, num_stages=dq_launch.num_stages)
        BACKWARD_DKDV.check_constexprs(dkdv)
        BACKWARD_DQ.check_constexprs(dq)
        pre_block = 64 if not interpreter_enabled() else 128
        preprocess = dict(V_HEAD_DIM=Ev, V_HEAD_DIM_P2=max(16, next_pow2(Ev)), BLOCK_M=pre_block, HAS_DLSE=problem.grad_lse is not None)
        steps = {
            "preprocess": Step(BACKWARD_PREPROCESS, (cdiv(L, pre_block), Hq, B), preprocess),
            "dkdv": Step(BACKWARD_DKDV, (cdiv(S, cfg.BLOCK_N1), Hkv, B), dkdv),
            "dq": Step(BACKWARD_DQ, (cdiv(L, cfg.BLOCK_M2), Hq, B), dq),
        }
        return Plan(compiled, steps, (L, S), q.element_size(), check_compiled=chosen_here)

    def _smaller_plan(self, plan: Plan, options: dict) -> Optional[Plan]:
        """One pipeline stage for both kernels, then half of the larger program's larger tile (the
        walked one on a tie), not below 16; None when nothing is left to shrink or the tiles are
        pinned (see [Note] Resource fallback in kernels/family.py)."""
        if backward_pinned(options):
            return None
        dkdv, dq = dict(plan.constexprs("dkdv")), dict(plan.constexprs("dq"))
        if dkdv["num_stages"] > 1 or dq["num_stages"] > 1:
            for c in (dkdv, dq):
                c["num_stages"] = c["NUM_STAGES"] = 1
            return plan.with_constexprs("dkdv", **dkdv).with_constexprs("dq", **dq)
        programs = [("dkdv", dkdv), ("dq", dq)]
        programs.sort(key=lambda p: p[1]["BLOCK_M"] * p[1]["BLOCK_N"], reverse=True)
        for role, c in programs:
            roles = self.TILE_ROLES[role]
            name = roles.walked if c[roles.walked] >= c[roles.owned] else roles.owned
            if c[name] > 16:
                c[name] //= 2
                break
        else:
            return None
        for role, c in (("dkdv", dkdv), ("dq", dq)):
            plan = with_tiles(plan, role, self.TILE_ROLES[role], c)
        return plan

    def _resource_error(self, plan: Plan, err: Exception) -> ResourceError:
        dkdv, dq = plan.constexprs("dkdv"), plan.constexprs("dq")
        tiles = (f"BLOCK_M1={dkdv['BLOCK_M']}, BLOCK_N1={dkdv['BLOCK_N']}, BLOCK_M2={dq['BLOCK_M']}, "
                 f"BLOCK_N2={dq['BLOCK_N']}, stages {dkdv['num_stages']} and {dq['num_stages']}")
        return ResourceError(
            f"the Triton backward for {self._names()} does not fit this GPU with tiles {tiles} "
            f"({err}); pass smaller tiles (kernel_options BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, "
            "bwd_num_stages) or run it with kernel_options={'BACKEND': 'PYTORCH'}"
        )

    def _tuned(self, problem: Problem, compiled: CompiledKernel, default: BackwardConfig) -> BackwardConfig:
        """AUTOTUNE: time a few tile shapes once per shape class; the choice is kept in the same file
        as the forward's (configs.tuned_configs), so later processes reuse it. A stored choice sets
        only the speed: every fact correctness depends on is derived from the call in _plan."""
        import triton
        import triton.testing

        q, k, v, block_mask = problem.q, problem.k, problem.v, problem.block_mask
        E, Ev = q.shape[-1], v.shape[-1]
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        key = "|".join(str(x) for x in (
            "backward", compiled.readable_name, compiled.source_digest, torch.cuda.get_device_name(q.device),
            triton.__version__, q.dtype, input_precision(q.dtype), E, Ev, next_pow2(q.shape[2]),
            next_pow2(k.shape[2]), q.shape[1] // k.shape[1], sparse_q, sparse_kv,
        ))
        stored = tuned_configs.get_entry(key)
        if stored is not None:
            return BackwardConfig(**stored)
        tuned_configs.searches += 1
        shapes = [(64, 128, 128, 64), (32, 128, 128, 32), (64, 64, 64, 64), (32, 64, 64, 32)]
        candidates = {default} | {
            fit_backward(BackwardConfig(*shape, warps, stages, USE_TMA=default.USE_TMA), sparse_q, sparse_kv)
            for shape in shapes for warps in (4, 8) for stages in (2, 3)
        }
        limit = max_shared_memory(q.device)
        qk_p2, v_p2 = next_pow2(E), next_pow2(Ev)
        # Timing inputs: the call's own tensors, a made-up output and LSE (speed does not depend on them).
        out = torch.randn(q.shape[:-1] + (Ev,), dtype=q.dtype, device=q.device)
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        grad_out = torch.randn_like(out)
        timings = []
        for cfg in sorted(candidates, key=lambda c: (c != default, str(c))):
            if backward_shared_memory_bytes(cfg, q.dtype.itemsize, qk_p2, v_p2) > limit:
                continue
            pinned = {name: getattr(cfg, name) for name in BACKWARD_TILE_KEYS}
            pinned.update(bwd_num_warps=cfg.num_warps, bwd_num_stages=cfg.num_stages, USE_TMA=cfg.USE_TMA)

            def run():
                self(q, k, v, out, lse, grad_out, None, block_mask, problem.scale, problem.score_captured,
                     problem.mask_captured, pinned)

            try:
                timings.append((triton.testing.do_bench(run, warmup=3, rep=20, return_mode="median"), cfg))
            except Exception:  # a shape the compiler rejects (resources) is simply not a candidate
                continue
        best = min(timings, key=lambda t: t[0])[1] if timings else default
        tuned_configs.put_entry(key, dict(best.__dict__))
        return best


def preprocess_delta(module, step: Step, out: torch.Tensor, grad_out: torch.Tensor,
                     grad_lse: Optional[torch.Tensor], repeated: Optional[RepeatedLaunch] = None) -> torch.Tensor:
    """DELTA = rowsum(dO * O) - dLSE, a contiguous [B, H, L] float32 buffer, by the preprocess kernel
    of ``module`` (templates/backward_preprocess.py.jinja; the Hopper backward runs it too).
    ``repeated``: a warm call's launch of this step ([Note] Ready launches in kernels/launch.py)."""
    B, Hq, L = out.shape[:3]
    delta = empty_output((B, Hq, L), torch.float32, out.device)
    dlse = grad_lse.contiguous().float() if grad_lse is not None else delta
    args = BACKWARD_PREPROCESS.pack(
        OUT=out, DO=grad_out, DLSE=dlse, DELTA=delta, stride_o=out.stride(), stride_do=grad_out.stride(), Q_LEN=L,
    )
    if repeated is None:
        launch(module.kernel(BACKWARD_PREPROCESS), step.grid, args, step.constexprs)
    else:
        repeated(args, fresh_aligned=not (delta.data_ptr() | dlse.data_ptr()) & 15)
    return delta


def preprocess_launch(plan: Plan) -> RepeatedLaunch:
    """The preprocess step of ``plan``, for a warm call to repeat (``preprocess_delta``'s ``repeated``)."""
    step = plan.steps["preprocess"]
    return RepeatedLaunch(plan.compiled.kernel(BACKWARD_PREPROCESS), step.grid, step.constexprs)


class WarmBackwardLaunch:
    """BackwardKernel._launch of one problem's plan, for its later calls ([Note] Ready launches in
    kernels/launch.py): the launches' ints and the launch order worked out once from the first
    call; each call allocates, fills in its tensors and launches the three kernels. No gradients of
    captured tensors, no broadcast key/value batch (``kept_plan`` returns None for those)."""

    def __init__(self, family: BackwardKernel, plan: Plan, q, k, v, out, grad_out, tables, bwd_tables, scale: float):
        module = plan.compiled
        self.family, self.plan = family, plan
        self.use_tma = plan.constexprs("dkdv")["USE_TMA"]
        self.preprocess = preprocess_launch(plan)
        dkdv, dq = plan.steps["dkdv"], plan.steps["dq"]
        self.dkdv = RepeatedLaunch(module.kernel(BACKWARD_DKDV), dkdv.grid, dkdv.constexprs)
        self.dq = RepeatedLaunch(module.kernel(BACKWARD_DQ), dq.grid, dq.constexprs)
        # Fresh outputs are contiguous: their strides are those of a contiguous tensor of the shape.
        self.dkdv_fixed, self.dq_fixed = _problem_args(plan, q, k, v, grad_out, _contiguous(k.shape),
                                                       _contiguous(v.shape), _contiguous(q.shape), tables, bwd_tables,
                                                       scale)
        self.dkdv_fixed.update(GRAD_SLOTS=1, GRAD_SLOT_STRIDE=0)

    def __call__(self, q, k, v, out, lse, grad_out, grad_lse, tables, bwd_tables, score_captured, mask_captured):
        global launches
        if self.use_tma:
            install_tma_allocator()  # per call: plans are shared by threads, allocators are not
        plan, device = self.plan, q.device
        delta = preprocess_delta(plan.compiled, plan.steps["preprocess"], out, grad_out, grad_lse, self.preprocess)
        dk, dv = empty_output(k.shape, k.dtype, device), empty_output(v.shape, v.dtype, device)
        dq = empty_output(q.shape, q.dtype, device)
        lse = lse.contiguous()
        mods = mod_launch_args(score_captured) + mod_launch_args(mask_captured)
        fresh = not (delta.data_ptr() | lse.data_ptr() | dk.data_ptr() | dv.data_ptr() | dq.data_ptr()) & 15
        qkvo = (q, k, v, grad_out)
        self.dkdv(_pack_dkdv(qkvo, lse, delta, dk, dv, delta, bwd_tables, mods, self.dkdv_fixed), fresh)
        self.dq(_pack_dq(qkvo, lse, delta, dq, tables, mods, self.dq_fixed), fresh)
        launches += 1
        self.family.last_plan = plan
        return dq, dk, dv


class _EveryCallLaunch(NamedTuple):
    """``launch`` of one kernel, grid and constexprs, the specialisation facts read from each call's
    arguments (a RepeatedLaunch keeps the first call's; an eager call's key does not fix them)."""

    jit_fn: object
    grid: tuple
    constexprs: dict

    def __call__(self, args: tuple, fresh_aligned: bool):
        return launch(self.jit_fn, self.grid, args, self.constexprs)


class PreparedBackward(WarmBackwardLaunch, PreparedLaunch):
    """WarmBackwardLaunch for the eager calls of one plan key ([Note] Prepared eager launches in
    kernels/family.py): ``also_serves`` checks what the backward's key leaves out besides the plan
    and the scale (the tables' widths, 16-byte alignment under tensor descriptors), and every launch
    takes Triton's specialisation facts from its own arguments."""

    def __init__(self, family: BackwardKernel, plan: Plan, problem: Problem):
        super().__init__(family, plan, problem.q, problem.k, problem.v, problem.out, problem.grad_out,
                         problem.tables, problem.bwd_tables, problem.scale)
        module = plan.compiled
        self.preprocess, self.dkdv, self.dq = (
            _EveryCallLaunch(module.kernel(params), plan.steps[role].grid, plan.steps[role].constexprs)
            for params, role in ((BACKWARD_PREPROCESS, "preprocess"), (BACKWARD_DKDV, "dkdv"), (BACKWARD_DQ, "dq")))
        self.scale = problem.scale
        self.widths = _table_widths(problem.tables, problem.bwd_tables)

    def also_serves(self, problem: Problem) -> bool:
        if _table_widths(problem.tables, problem.bwd_tables) != self.widths:
            return False
        return not (self.use_tma and (problem.q.data_ptr() | problem.k.data_ptr() | problem.v.data_ptr()
                                      | problem.grad_out.data_ptr()) % 16)

    def run(self, problem: Problem):
        dq, dk, dv = self(problem.q, problem.k, problem.v, problem.out, problem.lse, problem.grad_out,
                          problem.grad_lse, problem.tables, problem.bwd_tables, problem.score_captured,
                          problem.mask_captured)
        return dq, dk, dv, [None] * len(problem.score_captured)


def _table_widths(tables, bwd_tables) -> tuple:
    """The tables' sizes the launches pass that a plan key does not hold (it holds the row table's shape)."""
    return (tables.kv_indices.shape[3], tables.full_kv_indices.shape[3], bwd_tables.q_num_blocks.shape[2],
            bwd_tables.q_indices.shape[3], bwd_tables.full_q_indices.shape[3])


def _contiguous(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _plan_key(problem: Problem) -> tuple:
    """What a backward plan depends on (see [Note] Cache keys in kernels/family.py)."""
    q, k, v, options = problem.q, problem.k, problem.v, problem.options
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), problem.grad_out.stride(), problem.out.stride(),
        q.dtype, q.device, problem.block_mask.BLOCK_SIZE, problem.tables.plan_key, problem.scale > 0,
        problem.grad_lse is not None, tuple(sorted(options.items())) if options else (),
        torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None, problem.float32_kv_grads,
        problem.deterministic,
    )


def _problem_args(plan: Plan, q, k, v, grad_out, dk_strides, dv_strides, dq_strides, tables, bwd_tables,
                  scale: float) -> tuple[dict, dict]:
    """The dK/dV and dQ launches' ints and floats (less the gradient slots): the same for every call
    of one problem, so a warm launch works them out once."""
    B, _, L, _ = q.shape
    S = k.shape[2]
    k_strides, v_strides = kv_strides(k, v, B)
    alike = rows_alike(tables, S, plan.constexprs("dkdv")["SPARSE_KV_BLOCK_SIZE"])
    common = dict(stride_q=q.stride(), stride_k=k_strides, stride_v=v_strides, stride_do=grad_out.stride(),
                  Q_LEN=L, KV_LEN=S, SM_SCALE=scale)
    qn, qi, fqi = bwd_tables.q_num_blocks, bwd_tables.q_indices, bwd_tables.full_q_indices
    dkdv = dict(common, stride_dk=dk_strides, stride_dv=dv_strides, SPARSE_COLS=qn.shape[2], IDX_ROWS=qi.shape[3],
                FULL_IDX_ROWS=fqi.shape[3], TAIL_PAIRS=tail_pairs(plan.steps["dkdv"].grid, q.device, alike))
    dq = dict(common, stride_dq=dq_strides, SPARSE_ROWS=tables.kv_num_blocks.shape[2],
              IDX_COLS=tables.kv_indices.shape[3], FULL_IDX_COLS=tables.full_kv_indices.shape[3],
              TAIL_PAIRS=tail_pairs(plan.steps["dq"].grid, q.device, alike))
    return dkdv, dq


def _pack_dkdv(qkvo: tuple, lse, delta, dk, dv, turns, bwd_tables, mods: list, fixed: dict) -> tuple:
    """The dK/dV kernel's arguments: Q, K, V, dO, the row statistics, the outputs, the transposed
    tables, the mods' tensors (and gradient buffers), and ``fixed`` (_problem_args, the slots)."""
    q, k, v, grad_out = qkvo
    return BACKWARD_DKDV.pack(
        Q=q, K=k, V=v, DO=grad_out, LSE=lse, DELTA=delta, DK=dk, DV=dv, Q_NUM_BLKS=bwd_tables.q_num_blocks,
        Q_IDX=bwd_tables.q_indices, FULL_Q_NUM_BLKS=bwd_tables.full_q_num_blocks,
        FULL_Q_IDX=bwd_tables.full_q_indices, GRAD_TURNS=turns, mods=mods, **fixed,
    )


def _pack_dq(qkvo: tuple, lse, delta, dq, tables, mods: list, fixed: dict) -> tuple:
    """The dQ kernel's arguments: Q, K, V, dO, the row statistics, the output, the forward tables,
    the mods' tensors, and ``fixed`` (_problem_args)."""
    q, k, v, grad_out = qkvo
    return BACKWARD_DQ.pack(
        Q=q, K=k, V=v, DO=grad_out, LSE=lse, DELTA=delta, DQ=dq, KV_NUM_BLKS=tables.kv_num_blocks,
        KV_IDX=tables.kv_indices, FULL_KV_NUM_BLKS=tables.full_kv_num_blocks, FULL_KV_IDX=tables.full_kv_indices,
        mods=mods, **fixed,
    )


# Gradient slots of the deterministic backward: one per program when they fit this many bytes (per
# learnable tensor), else fewer, reused in turn; never fewer than four per multiprocessor, so that a
# program seldom waits for its slot's previous owner.
SLOT_BYTES = 256 << 20


def gradient_slots(programs: int, numel: int, device: torch.device) -> int:
    """How many slots of ``numel`` float32 elements the deterministic dK/dV kernel gets."""
    if device.type != "cuda" or interpreter_enabled():
        return programs  # the interpreter runs programs one after another in its own order: no waiting
    floor = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(programs, max(SLOT_BYTES // (4 * numel), floor)))


_kernels: "OrderedDict[tuple, BackwardKernel]" = OrderedDict()  # see [Note] Cache keys in kernels/family.py


def backward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool = False) -> BackwardKernel:
    """The backward kernels for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, BackwardKernel, score, mask, tanh_approx)
