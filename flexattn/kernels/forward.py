"""The forward kernel family: one FlashAttention-2 kernel per pair of traced mods
(templates/forward.py.jinja), its launch plans and its launches.

A plan holds one step, ``"forward"``: one program per BLOCK_M queries of one query head, walking
the key blocks the BlockMask lists for its row (partial blocks with the mask_mod, then full ones
without), writing the output and, when asked, the LSE and the row maxima.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from ..codegen import kernel_index
from ..codegen.params import FORWARD
from ..errors import ResourceError
from ..masks.layout import cdiv
from ..options import deterministic as requested_determinism
from ..trace import TracedMod
from .configs import (
    OPTION_KEYS, candidate_configs, input_precision, kv_as_float16, max_shared_memory, next_pow2, pinned_config,
    select_config, shared_memory_bytes, tuned_configs, upcast_dots,
)
from .family import (
    CompiledKernel, KernelFamily, Plan, PreparedLaunch, Problem, Step, TileRoles, cached_kernel, with_tiles,
)
from .launch import (
    FLOAT8_DTYPES, RepeatedLaunch, descriptor_over, descriptor_template, empty_attention_output, empty_output,
    empty_strided_output, finished_output, interpreter_enabled, kv_strides, launch, mod_launch_args,
)
from .launch_order import rows_alike, tail_pairs
from .ahead import recording
from .tables import launch_tables
from .tma import host_descriptors, host_descriptors_ok, install_tma_allocator, tma_layout_ok

__all__ = ["ForwardKernel", "MergingForwardKernel", "WarmForwardLaunch", "forward_kernel", "merging_forward_kernel"]


class ForwardKernel(KernelFamily):
    """The forward kernels of one pair of traced mods: one compiled source per lowering variant,
    and one launch plan per problem (see [Note] Cache keys in kernels/family.py)."""

    kind = "forward"
    # One program owns BLOCK_M queries (Q once) and walks the keys BLOCK_N at a time (K and V).
    TILE_ROLES = {"forward": TileRoles(owned="BLOCK_M", owned_even="EVEN_M", owned_length=0, walked="BLOCK_N",
                                       owned_width=("QK_HEAD_DIM_P2",),
                                       walked_width=("QK_HEAD_DIM_P2", "V_HEAD_DIM_P2"))}

    def __call__(
        self, q, k, v, block_mask, scale: float, score_captured, mask_captured, *,
        need_lse: bool, need_max: bool, options: dict,
    ):
        """``(out, lse or None, max_scores or None)``."""
        if v.dtype in FLOAT8_DTYPES:
            v = fp8_value_layout(q, v)
        problem = Problem(q, k, v, block_mask, launch_tables(block_mask), scale, score_captured, mask_captured,
                          options, need_lse, need_max)
        key = _plan_key(problem)
        result = self._prepared_result(key, problem)
        if result is not None:
            return result
        result = self._run(key, problem)
        self._prepare(key, problem)
        return result

    def _prepare(self, key: tuple, problem: Problem) -> None:
        """After a call of ``key`` ran its plan the long way: that launch, worked out for the next
        calls of the key ([Note] Prepared eager launches in kernels/family.py)."""
        q, k, v = problem.q, problem.k, problem.v
        plan = self._plans.get(key)
        if (plan is None or plan.check_compiled or recording() or not q.dtype == k.dtype == v.dtype
                or q.dtype in FLOAT8_DTYPES or self._for_call(plan, problem) is not plan):
            return
        self._keep_prepared(key, PreparedForward(self, plan, problem))

    def kept_plan(self, q, k, v, block_mask, scale: float, *, need_lse: bool, need_max: bool,
                  options: dict) -> Optional[Plan]:
        """The plan a call with these arguments launches now, once its problem's plan has settled (its
        kernels compiled and checked, [Note] Tiles the compiler made costly), else None: for a caller
        that launches it again through ``warm_launch`` (compile/warm.py, [Note] Warm calls of the forward op).
        Not for FP8 values, which a call may copy first (fp8_value_layout)."""
        if v.dtype in FLOAT8_DTYPES:
            return None
        problem = Problem(q, k, v, block_mask, launch_tables(block_mask), scale, (), (), options, need_lse, need_max)
        plan = self._plans.get(_plan_key(problem))
        return None if plan is None or plan.check_compiled else self._for_call(plan, problem)

    def warm_launch(self, plan: Plan, q, k, v, tables, scale: float, *, need_lse: bool,
                    need_max: bool) -> "WarmForwardLaunch":
        """``plan`` (from kept_plan) for the later calls of this call's problem: same shapes, strides,
        dtypes, 16-byte alignment and table statistics, which the caller keys (compile/warm.py, [Note] Warm
        calls of the forward op). Call it as ``(q, k, v, tables, score_captured, mask_captured)``."""
        return WarmForwardLaunch(self, plan, q, k, v, tables, scale, need_lse, need_max)

    def _for_call(self, plan: Plan, problem: Problem) -> Plan:
        """The plan this call runs: ``plan``, or, for an unaligned view of a problem whose plan reads
        through tensor descriptors (same shapes and strides as its first call), the plan without them."""
        if plan.constexprs("forward")["USE_TMA"] and (
                problem.q.data_ptr() | problem.k.data_ptr() | problem.v.data_ptr()) % 16:
            return plan.with_constexprs("forward", USE_TMA=False, HOST_DESCRIPTORS=False, WARP_SPECIALIZE=False)
        return plan

    def _launch(self, plan: Plan, problem: Problem):
        q, k, v, tables = problem.q, problem.k, problem.v, problem.tables
        need_lse, need_max = problem.need_lse, problem.need_max
        B, Hq, L, _ = q.shape
        step = plan.steps["forward"]
        constexprs = step.constexprs
        if constexprs["USE_TMA"]:
            install_tma_allocator()  # per call: plans are shared by threads, allocators are not
        out = empty_attention_output(q, v.shape[3])
        lse = empty_output((B, Hq, L), torch.float32, q.device) if need_lse else out
        mx = empty_output((B, Hq, L), torch.float32, q.device) if need_max else out
        q_arg, k_arg, v_arg, out_arg = q, k, v, out
        if constexprs["HOST_DESCRIPTORS"]:
            q_arg, k_arg, v_arg, out_arg = host_descriptors(q, k, v, out, constexprs)
        args = _pack(self, (q_arg, k_arg, v_arg, out_arg), lse, mx, tables, problem.score_captured,
                     problem.mask_captured, _problem_args(step, q, k, v, out.stride(), tables, problem.scale))
        kernel = launch(plan.compiled.kernel(FORWARD), step.grid, args, constexprs)
        return (finished_output(out, q), (lse if need_lse else None), (mx if need_max else None)), {"forward": kernel}

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        """Grid, constexprs and kernel for one problem: computed once, reused by every later call."""
        q, k, v, tables, scale, options = problem.q, problem.k, problem.v, problem.tables, problem.scale, problem.options
        need_lse, need_max = problem.need_lse, problem.need_max
        B, Hq, L, E = q.shape
        Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[3]
        sparse_q, sparse_kv = problem.block_mask.BLOCK_SIZE
        stats = tables.stats
        cfg = self._config(problem, compiled)
        use_tma = bool(options.get("USE_TMA", cfg.USE_TMA)) and tma_layout_ok(q, k, v)
        # Never with mods or row maxima, even when asked for: Triton 3.6 gets those wrong (see
        # _HOPPER_WS_CONFIG in configs.py), and a fast wrong answer is not an option. The LSE is
        # stored through a descriptor under warp specialisation, which needs 16-byte aligned rows of it.
        warp_specialize = (use_tma and bool(options.get("WARP_SPECIALIZE", cfg.WARP_SPECIALIZE))
                           and not (need_max or self.has_score_mod or self.has_mask_mod)
                           and not (need_lse and L % 4))
        # Triton's warp specialisation rejects 4-D descriptors (3.9: "descriptor block and tensor
        # must have the same number of elements"); its loops are long, so in-kernel ones cost little.
        use_host_descriptors = (use_tma and not warp_specialize and host_descriptors_ok(q, k, v)
                                and bool(options.get("HOST_DESCRIPTORS", cfg.HOST_DESCRIPTORS)))
        constexprs = dict(
            SPARSE_Z=tables.kv_num_blocks.shape[0], SPARSE_HQ=tables.kv_num_blocks.shape[1],
            GQA_GROUP=Hq // Hkv,
            QK_HEAD_DIM=E, QK_HEAD_DIM_P2=max(16, next_pow2(E)),
            V_HEAD_DIM=Ev, V_HEAD_DIM_P2=max(16, next_pow2(Ev)),
            SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
            EVEN_M=L % cfg.BLOCK_M == 0, EVEN_N=S % sparse_kv == 0,
            HAS_SCORE_MOD=self.has_score_mod,
            # The mods see the scaled score; the scale folds into the exp2 only when it is positive.
            SCALE_FIRST=self.has_score_mod or scale <= 0,
            HAS_PARTIAL_BLOCKS=self.has_mask_mod, HAS_FULL_BLOCKS=tables.has_full,
            # See [Note] Consecutive blocks in the forward template.
            CONSECUTIVE_PARTIAL=stats.consecutive_partial, CONSECUTIVE_FULL=stats.consecutive_full,
            OUTPUT_LSE=need_lse, OUTPUT_MAX=need_max,
            INPUT_PRECISION=input_precision(q.dtype), NUM_STAGES=cfg.num_stages,
            UPCAST_DOTS=upcast_dots(q.dtype) and not kv_as_float16(q, k, v),
            KV_AS_FLOAT16=kv_as_float16(q, k, v),
            USE_TMA=use_tma,
            HOST_DESCRIPTORS=use_host_descriptors,
            WARP_SPECIALIZE=warp_specialize,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        FORWARD.check_constexprs(constexprs)
        chosen_here = not (OPTION_KEYS & options.keys() or options.get("AUTOTUNE"))
        return Plan(compiled, {"forward": Step(FORWARD, (cdiv(L, cfg.BLOCK_M), Hq, B), constexprs)}, (L, S),
                    q.element_size(), check_compiled=chosen_here and q.device.type == "cuda" and not interpreter_enabled())

    def _smaller_plan(self, plan: Plan, options: dict) -> Optional[Plan]:
        """One pipeline stage, then half the key tile, then half the query tile (see [Note] Resource
        fallback in kernels/family.py); None once both tiles are 16 and one stage is left."""
        c = dict(plan.constexprs("forward"))
        if c["num_stages"] > 1:
            c["num_stages"] = c["NUM_STAGES"] = 1
        elif c["BLOCK_N"] > 16:
            c["BLOCK_N"] //= 2
        elif c["BLOCK_M"] > 16:
            c["BLOCK_M"] //= 2
        else:
            return None
        # Descriptor and warp-specialised loads were tuned for the original tiles: plain loads now.
        c.update(USE_TMA=False, HOST_DESCRIPTORS=False, WARP_SPECIALIZE=False)
        return with_tiles(plan, "forward", self.TILE_ROLES["forward"], c)

    def _resource_error(self, plan: Plan, err: Exception) -> ResourceError:
        return ResourceError(
            f"the Triton kernel for {self._names()} does not fit this GPU even with 16x16 tiles and one "
            f"pipeline stage ({err}); simplify the mod (fewer captured-tensor reads per pair) or run it "
            "with kernel_options={'BACKEND': 'PYTORCH'}"
        )

    # ---------------------------------------------------------------- configs
    def _config(self, problem: Problem, compiled: CompiledKernel):
        q, k, v, options = problem.q, problem.k, problem.v, problem.options
        need_lse, need_max = problem.need_lse, problem.need_max
        block_mask, stats = problem.block_mask, problem.tables.stats
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        E, Ev = q.shape[-1], v.shape[-1]
        # Scores the kernel computes: what sets its GPU time.
        scores = q.shape[0] * q.shape[1] * block_mask.kv_num_blocks.shape[2] * stats.mean_blocks * sparse_q * sparse_kv
        default = select_config(
            q.device, q.dtype, E, Ev, sparse_q, sparse_kv,
            has_mask_mod=self.has_mask_mod,
            blocks_per_row=stats.mean_blocks if self.has_mask_mod else float("inf"),
            # Descriptors cost host time per launch (scratch for them, a longer launch); on problems
            # below about a million scores the launch, not the kernel, sets the pace. Host-built
            # ones cost more again (docs/benchmarks.md, "Start-up and host overhead"), so only kernels
            # of 2^28 scores and up (long enough on the GPU to hide them) get them.
            has_score_mod=self.has_score_mod, tma_ok=tma_layout_ok(q, k, v) and q.shape[2] * k.shape[2] >= 1 << 20,
            host_descriptors_ok=host_descriptors_ok(q, k, v) and scores >= 1 << 28,
            even_n=k.shape[2] % sparse_kv == 0, row_stats=need_max or (need_lse and q.shape[2] % 4 != 0),
        )
        if OPTION_KEYS & options.keys():
            return pinned_config(options, default, sparse_q, sparse_kv)
        if not options.get("AUTOTUNE") or interpreter_enabled() or q.device.type != "cuda":
            return default
        import triton

        # A stored choice only sets the speed: every launch fact that correctness depends on is
        # re-derived from the call in _plan. So the key is a shape class, not the exact problem.
        key = "|".join(
            str(x) for x in (
                compiled.readable_name, compiled.source_digest, torch.cuda.get_device_name(q.device),
                triton.__version__, q.dtype, input_precision(q.dtype), E, Ev, next_pow2(q.shape[2]),
                next_pow2(k.shape[2]), q.shape[1] // k.shape[1], sparse_q, sparse_kv, need_lse or need_max,
            )
        )
        cached = tuned_configs.get(key)
        if cached is not None:
            return cached
        tuned_configs.searches += 1
        best = self._autotune(problem, default)
        tuned_configs.put(key, best)
        return best

    def _autotune(self, problem: Problem, default):
        import triton.testing

        q, k, v, block_mask = problem.q, problem.k, problem.v, problem.block_mask
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE

        limit = max_shared_memory(q.device)
        qk_p2, v_p2 = next_pow2(q.shape[-1]), next_pow2(v.shape[-1])
        timings = []
        for cfg in candidate_configs(default, sparse_q, sparse_kv):
            if shared_memory_bytes(cfg, q.dtype.itemsize, qk_p2, v_p2) > limit:
                continue
            pinned = {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "num_warps": cfg.num_warps,
                      "num_stages": cfg.num_stages, "USE_TMA": cfg.USE_TMA, "WARP_SPECIALIZE": cfg.WARP_SPECIALIZE,
                      "HOST_DESCRIPTORS": cfg.HOST_DESCRIPTORS}

            def run():
                self(q, k, v, block_mask, problem.scale, problem.score_captured, problem.mask_captured,
                     need_lse=problem.need_lse, need_max=problem.need_max, options=pinned)

            try:
                ms = triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")
            except Exception:  # a config the compiler rejects (resources) is simply not a candidate
                continue
            timings.append((ms, cfg))
        if not timings:
            return default
        return min(timings, key=lambda t: t[0])[1]


class MergingForwardKernel(ForwardKernel):
    """The forward kernels of one pair of traced mods whose epilogue merges the launch's rows into a
    running result, in place, instead of writing fresh outputs: context parallelism's steps after a
    row's first ([Note] Merging into the running result, templates/forward.py.jinja). Its plans are
    ForwardKernel's, but for what a launch that reads its outputs rules out:
    - a second launch of one call: a deterministic call keeps its first plan (the replan rule's
      settling would launch again, and merge twice), and AUTOTUNE is not run (its trial launches
      would merge as many times) but for the default or pinned tiles;
    - the warp-specialised loop, under which Triton 3.6 loses rows of row vectors stored through
      pointers (the merge reads and writes the LSE so);
    - prepared and warm launches: each call takes the long way (its host time is a small part of a
      step's), and ``kept_plan`` has none to give (a warm launch fills fresh outputs).
    """

    def __call__(self, q, k, v, block_mask, scale: float, score_captured, mask_captured, *, running: tuple,
                 options: dict) -> None:
        """Merge this call's rows into ``running`` = ``(out, lse, max_scores or None)``: ``out`` a
        float32 [B, Hq, L, Ev] tensor of any strides, ``lse`` and ``max_scores`` contiguous float32
        [B, Hq, L]. ``max_scores`` given, the row maxima merge too."""
        options = {key: value for key, value in options.items() if key != "AUTOTUNE"}
        problem = Problem(q, k, fp8_value_layout(q, v), block_mask, launch_tables(block_mask), scale, score_captured,
                          mask_captured, options, need_lse=True, need_max=running[2] is not None, running=running)
        self._run(_plan_key(problem), problem)

    def kept_plan(self, *args, **kwargs) -> None:
        return None

    def _spec(self, variants: tuple):
        return dataclasses.replace(super()._spec(variants), merge_into_running=True)

    def _index_key(self, variants: tuple):
        key = super()._index_key(variants)
        return None if key is None else kernel_index.key(("merge_into_running", key))

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        plan = super()._plan(problem, compiled).with_constexprs("forward", WARP_SPECIALIZE=False)
        return plan._replace(check_compiled=False) if requested_determinism(problem.options) else plan

    def _launch(self, plan: Plan, problem: Problem):
        q, k, v, tables = problem.q, problem.k, problem.v, problem.tables
        step = plan.steps["forward"]
        constexprs = step.constexprs
        if constexprs["USE_TMA"]:
            install_tma_allocator()  # per call: plans are shared by threads, allocators are not
        out, lse, mx = problem.running
        q_arg, k_arg, v_arg = q, k, v
        if constexprs["HOST_DESCRIPTORS"]:  # for Q, K and V; the running output is read through pointers
            q_arg, k_arg, v_arg, _ = host_descriptors(q, k, v, None, constexprs)
        args = _pack(self, (q_arg, k_arg, v_arg, out), lse, out if mx is None else mx, tables, problem.score_captured,
                     problem.mask_captured, _problem_args(step, q, k, v, out.stride(), tables, problem.scale))
        kernel = launch(plan.compiled.kernel(FORWARD), step.grid, args, constexprs)
        return None, {"forward": kernel}


class WarmForwardLaunch:
    """ForwardKernel._launch of one problem's plan, for its later calls ([Note] Ready launches in
    kernels/launch.py): the output's strides, the launch's ints, the launch order and the
    descriptors' shapes are worked out once from the first call; each call allocates, fills in its
    tensors and launches. ``(out, lse or None, max_scores or None)``."""

    def __init__(self, family: ForwardKernel, plan: Plan, q, k, v, tables, scale: float, need_lse: bool,
                 need_max: bool):
        B, Hq, L, _ = q.shape
        step = plan.steps["forward"]
        constexprs = step.constexprs
        self.family, self.plan, self.constexprs = family, plan, constexprs
        self.launch = RepeatedLaunch(plan.compiled.kernel(FORWARD), step.grid, constexprs)
        self.need_lse, self.need_max = need_lse, need_max
        sample = empty_attention_output(q, v.shape[3])  # the output's layout, and the descriptors' template
        self.out_shape, self.out_strides, self.stats_shape = tuple(sample.shape), sample.stride(), (B, Hq, L)
        self.fixed = _problem_args(step, q, k, v, sample.stride(), tables, scale)
        # Descriptors without the tensors: nothing of this call's is kept.
        self.templates = [descriptor_template(d) for d in host_descriptors(q, k, v, sample, constexprs)] \
            if constexprs["HOST_DESCRIPTORS"] else None
        # Whether every descriptor is copied from its template (not `None in templates`: the
        # descriptors' dataclass __eq__ would run at every call).
        self.copied = self.templates is not None and all(t is not None for t in self.templates)

    def __call__(self, q, k, v, tables, score_captured, mask_captured):
        device = q.device
        out = empty_strided_output(self.out_shape, self.out_strides, q.dtype, device)
        lse = empty_output(self.stats_shape, torch.float32, device) if self.need_lse else out
        mx = empty_output(self.stats_shape, torch.float32, device) if self.need_max else out
        q_arg, k_arg, v_arg, out_arg = q, k, v, out
        templates = self.templates
        if templates is not None:
            if not self.copied:
                q_arg, k_arg, v_arg, out_arg = host_descriptors(q, k, v, out, self.constexprs)
            else:
                q_arg, k_arg, v_arg, out_arg = (descriptor_over(d, t) for d, t in zip(templates, (q, k, v, out)))
        if self.constexprs["USE_TMA"]:
            install_tma_allocator()  # per call: plans are shared by threads, allocators are not
        family = self.family
        args = _pack(family, (q_arg, k_arg, v_arg, out_arg), lse, mx, tables, score_captured, mask_captured,
                     self.fixed)
        self.launch(args, fresh_aligned=not (out.data_ptr() | lse.data_ptr() | mx.data_ptr()) & 15)
        family.last_plan = self.plan
        return out, (lse if self.need_lse else None), (mx if self.need_max else None)


# The forward's prepared launch ([Note] Prepared eager launches in kernels/family.py) is the warm
# launch of compiled calls (WarmForwardLaunch: the output's layout, the launch's ints and launch
# order, descriptor templates). What the forward's key leaves out besides the plan and the scale,
# checked by ``also_serves``: the index tables' widths (the key holds the row table's shape), and
# the tensors' 16-byte alignment, which a plan with tensor descriptors needs (``_for_call``). FP8
# and mixed dtypes (a copied value, a float32 output converted after) and plans still settling take
# the long way. The backward does the same (PreparedBackward).


class _EveryCallLaunch(NamedTuple):
    """``launch`` of one kernel, grid and constexprs, the specialisation facts read from each call's
    arguments (a RepeatedLaunch keeps the first call's; an eager call's key does not fix them)."""

    jit_fn: object
    grid: tuple
    constexprs: dict

    def __call__(self, args: tuple, fresh_aligned: bool):
        return launch(self.jit_fn, self.grid, args, self.constexprs)


class PreparedForward(WarmForwardLaunch, PreparedLaunch):
    """WarmForwardLaunch for the eager calls of one plan key ([Note] Prepared eager launches in
    kernels/family.py)."""

    def __init__(self, family: ForwardKernel, plan: Plan, problem: Problem):
        super().__init__(family, plan, problem.q, problem.k, problem.v, problem.tables, problem.scale,
                         problem.need_lse, problem.need_max)
        step = plan.steps["forward"]
        self.launch = _EveryCallLaunch(plan.compiled.kernel(FORWARD), step.grid, step.constexprs)
        self.scale = problem.scale
        self.widths = (problem.tables.kv_indices.shape[3], problem.tables.full_kv_indices.shape[3])
        self.aligned_only = bool(step.constexprs["USE_TMA"])

    def also_serves(self, problem: Problem) -> bool:
        tables = problem.tables
        if (tables.kv_indices.shape[3], tables.full_kv_indices.shape[3]) != self.widths:
            return False
        return not (self.aligned_only and (problem.q.data_ptr() | problem.k.data_ptr() | problem.v.data_ptr()) % 16)

    def run(self, problem: Problem):
        return self(problem.q, problem.k, problem.v, problem.tables, problem.score_captured, problem.mask_captured)


def _problem_args(step: Step, q, k, v, out_strides: tuple, tables, scale: float) -> dict:
    """The forward's ints and floats: the same for every call of one problem (shapes, strides,
    table statistics), so a warm launch works them out once."""
    B, _, L, _ = q.shape
    k_strides, v_strides = kv_strides(k, v, B)
    return dict(
        stride_q=q.stride(), stride_k=k_strides, stride_v=v_strides, stride_o=out_strides,
        SPARSE_ROWS=tables.kv_num_blocks.shape[2], IDX_COLS=tables.kv_indices.shape[3],
        FULL_IDX_COLS=tables.full_kv_indices.shape[3], Q_LEN=L, KV_LEN=k.shape[2], SM_SCALE=scale,
        TAIL_PAIRS=tail_pairs(step.grid, q.device,
                              rows_alike(tables, k.shape[2], step.constexprs["SPARSE_KV_BLOCK_SIZE"])),
    )


def _pack(family: ForwardKernel, qkvo: tuple, lse, mx, tables, score_captured, mask_captured, fixed: dict) -> tuple:
    """The forward's arguments: Q, K, V and the output (tensors or descriptors), the row statistics'
    buffers, the tables, the mods' tensors, and ``fixed`` (_problem_args)."""
    q_arg, k_arg, v_arg, out_arg = qkvo
    return FORWARD.pack(
        Q=q_arg, K=k_arg, V=v_arg, OUT=out_arg, LSE=lse, MAX_SCORES=mx,
        KV_NUM_BLKS=tables.kv_num_blocks, KV_IDX=tables.kv_indices, FULL_KV_NUM_BLKS=tables.full_kv_num_blocks,
        FULL_KV_IDX=tables.full_kv_indices,
        mods=mod_launch_args(score_captured if family.has_score_mod else (),
                             mask_captured if family.has_mask_mod else ()),
        **fixed,
    )


def _plan_key(problem: Problem) -> tuple:
    """What a forward plan depends on (see [Note] Cache keys in kernels/family.py)."""
    q, k, v, options = problem.q, problem.k, problem.v, problem.options
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
        problem.block_mask.BLOCK_SIZE, problem.tables.plan_key,  # content, never id(block_mask)
        problem.need_lse, problem.need_max, problem.scale > 0, tuple(sorted(options.items())) if options else (),
        torch.get_float32_matmul_precision() if q.dtype == torch.float32 else None,
    )


def fp8_value_layout(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """V as the FP8 product P V wants it on compute capability 8.9 to 9.x: column-major (keys
    contiguous), copied there when it is not.

    [Note] FP8 values are column-major. Those GPUs' FP8 tensor-core products take both operands with the
    summed dimension contiguous. For P V that is the key dimension, and a row-major V makes Triton
    reorder every tile in the loop, so the copy (one pass over V) pays many times over
    (docs/benchmarks_log.md, "FP8 forward and FP8-cache decoding"). torch's flex_attention makes the
    same copy. A caller who keeps V column-major (``v.transpose(-2, -1).contiguous().transpose(-2,
    -1)``) skips it."""
    if (v.dtype not in FLOAT8_DTYPES or q.dtype != v.dtype or v.stride(-2) == 1 or not v.is_cuda
            or not (8, 9) <= torch.cuda.get_device_capability(v.device) < (10, 0)):
        return v
    return v.transpose(-2, -1).contiguous().transpose(-2, -1)


_kernels: "OrderedDict[tuple, ForwardKernel]" = OrderedDict()  # see [Note] Cache keys in kernels/family.py


def forward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool = False) -> ForwardKernel:
    """The forward kernel for these traced mods, built on first use and kept (the latest 256)."""
    return cached_kernel(_kernels, ForwardKernel, score, mask, tanh_approx)


_merging_kernels: "OrderedDict[tuple, MergingForwardKernel]" = OrderedDict()


def merging_forward_kernel(score: Optional[TracedMod], mask: Optional[TracedMod], *,
                           tanh_approx: bool = False) -> MergingForwardKernel:
    """The merging forward kernel for these traced mods (MergingForwardKernel), kept as forward_kernel's."""
    return cached_kernel(_merging_kernels, MergingForwardKernel, score, mask, tanh_approx)

