"""What the three kernel families (forward, backward, decode) share, written once: compiled sources
per lowering variant, a bounded table of launch plans, the launch loop with its out-of-resources
fallback, the replan rule for tiles the compiler made costly, and the table of families per pair
of traced mods.

Stage 4 of the pipeline (trace -> lowering -> codegen -> kernels). A family is built once per
(score_mod graph, mask_mod graph, tanh flag) and kept; its launch plans (grids, constexprs and the
lowering variant of the mods to run) are made once per problem and BlockMask content, so a warm
call only gathers pointers and strides and launches. Triton compiles each constexpr
specialisation once and caches it on disk.

[Note] Cache keys. Every cache in flexattn follows three rules, because a cache hit with a stale
entry is a wrong number with no error:
1. A key covers everything that can change the generated code or the launch (shapes, strides,
   dtypes, device, flags, the BlockMask's row statistics, the lowering variant, options).
2. No ``id()`` of an object that can die: CPython hands a freed object's id to the next one (a
   training loop that rebuilds its BlockMask each step got the previous mask's plan, issue 8).
   Objects in a key are held by the key itself (TracedMod, compared by identity, stays alive
   while it is a key), or the key is built from content.
3. Data derived from a mutable object lives on that object, stamped with what it came from
   (BlockMask.derived: table identities and version counters), or is keyed by content.
Every cache is bounded (least recently used entries go first).

The caches: each family module's ``_kernels`` (TracedMod pair, tanh flag), ``KernelFamily._compiled``
(lowering variants), ``KernelFamily._plans`` (shapes, strides, dtype, device, BlockMask content,
flags, options), ``KernelFamily._prepared`` (the plans' key, and what it leaves out checked at each
call: [Note] Prepared eager launches; the Gluon forward's: [Note] Prepared Gluon forward launches),
dispatch.py's kept Gluon choices (the facts their reasons read: [Note] The Gluon forward's choice,
kept), the decode's kept scratch (per thread, device, stream and
shape: [Note] Kept scratch in kernels/launch.py), the device copies of a mod's own constants (on
the TracedMod, per device), the tables derived from a BlockMask (on the mask, kernels/tables.py),
``codegen.source._loaded`` (source digest), the autotune store (source digest, device, shape class,
Triton version; kernels/configs.py), ``masks.create._dense_masks`` (lengths, device),
``lowering.ranges._VARIANTS`` and ``_WIDE`` (TracedMods, bounds), the direct launches of
kernels/launch.py (on each Triton kernel: device, specialisation facts, constexprs), and what was
compiled ahead (dispatch._AHEAD_DONE, compile/ops.py's _TRACED_AHEAD, kernels/ahead.py's sent
specialisations: problems and specialisations only, never read by a launch).
"""

from __future__ import annotations

import hashlib
import importlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, NamedTuple, Optional

from ..codegen import KernelSpec, kernel_index, load_kernel_module, render
from ..codegen.params import KernelParams
from ..errors import BackendUnavailableError, ResourceError
from ..lowering import LoweredMod, index_bounds, lower, lowering_variants
from ..lowering import ops as lowering_ops
from ..masks.layout import cdiv
from ..options import deterministic as requested_determinism
from ..trace import TracedMod
from .ahead import recording
from .launch import interpreter_enabled, is_out_of_resources, shared_bytes, spilled_bytes

__all__ = [
    "Problem", "CompiledKernel", "Step", "Plan", "TileRoles", "KernelFamily", "PreparedLaunch", "cached_kernel",
    "SPILL_LIMIT_BYTES", "STAGED_GATHER_BYTES",
]


@dataclass(frozen=True)
class CompiledKernel:
    """One rendered and imported kernel module: a family's kernels with the mods lowered for one
    lowering variant. What launches read of it is ``readable_name`` and ``trainable``; ``spec``, the
    lowered mods, is lowered again on first use for a module the kernel index found on disk
    (``make_spec``: no launch needs it)."""

    source: str
    source_digest: str
    module: ModuleType
    variants: tuple  # (score variant, mask variant) it was lowered for; None: any lengths
    readable_name: str
    # The score_mod's captured inputs with a gradient buffer in the backward kernels (LoweredScoreGrad.trainable).
    trainable: tuple
    lowered: Optional[KernelSpec] = None
    make_spec: Optional[Callable[[], KernelSpec]] = None

    @property
    def spec(self) -> KernelSpec:
        if self.lowered is None:
            object.__setattr__(self, "lowered", self.make_spec())  # frozen: kept once made
        return self.lowered

    def kernel(self, params: KernelParams):
        """The Triton kernel of this module that ``params`` declares."""
        return getattr(self.module, params.name)


class Problem(NamedTuple):
    """One call of a kernel family, as its plan key, plan, config and launch read it: built once by
    the family's ``__call__`` and handed on whole, rather than a dozen loose arguments through each.
    The forward and decode leave the backward's fields at their defaults."""

    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    block_mask: "BlockMask"
    tables: "LaunchTables"  # the BlockMask's checked forward tables (kernels/tables.py)
    scale: float
    score_captured: list  # the score_mod's captured values (tensors, then numbers)
    mask_captured: list
    options: dict  # kernel_options, normalised
    need_lse: bool = False
    need_max: bool = False
    # The backward's: the forward's output and LSE, their gradients, the transposed tables.
    out: "Optional[torch.Tensor]" = None
    lse: "Optional[torch.Tensor]" = None
    grad_out: "Optional[torch.Tensor]" = None
    grad_lse: "Optional[torch.Tensor]" = None
    bwd_tables: "Optional[BackwardTables]" = None
    float32_kv_grads: bool = False  # dk and dv in float32, unrounded (context parallelism sums several)
    deterministic: bool = False  # options.deterministic, read once
    # The merging forward's: (out, lse, max_scores or None) of other keys for these queries, which
    # its kernel reads and overwrites with the merged result (kernels/forward.py MergingForwardKernel).
    running: "Optional[tuple]" = None

    def bounds(self):
        """The lengths the lowering's decisions depend on (lowering.IndexBounds)."""
        B, Hq, L, _ = self.q.shape
        return index_bounds(B, Hq, L, self.k.shape[2])


class Step(NamedTuple):
    """One kernel launch of a plan: which kernel, its grid and its constexprs (launch options too)."""

    params: KernelParams
    grid: tuple
    constexprs: dict


class Plan(NamedTuple):
    """Everything about a problem's launches that does not change from call to call."""

    compiled: CompiledKernel
    steps: dict  # role ("forward", "dkdv", "partial", ...) -> Step
    lengths: tuple  # (Q_LEN, KV_LEN) of the problem
    elem_bytes: int  # of the inputs (the replan rule sizes their tiles)
    check_compiled: bool = False  # default tiles not yet seen compiled: see [Note] Tiles the compiler made costly
    extra: tuple = ()  # what one family's launch needs besides its steps (decode: the scratch rows)

    def constexprs(self, role: str) -> dict:
        return self.steps[role].constexprs

    def with_constexprs(self, role: str, **changes) -> "Plan":
        """This plan with ``changes`` to one step's constexprs (a fresh dict: plans are shared)."""
        step = self.steps[role]
        return self._replace(steps={**self.steps, role: step._replace(constexprs={**step.constexprs, **changes})})


class TileRoles(NamedTuple):
    """How one kernel's tiles relate to its grid, for the rules that change tiles after planning.

    A program owns ``owned`` rows (its grid's first dim cuts the owned length into them; ``owned_even``
    says whether that cut is exact) and walks the other side ``walked`` rows at a time. The widths
    name the constexprs whose sum is a row's width in the owned and walked tiles."""

    owned: str
    owned_even: str
    owned_length: int  # index into Plan.lengths
    walked: str
    owned_width: tuple
    walked_width: tuple


def with_tiles(plan: Plan, role: str, roles: TileRoles, constexprs: dict) -> Plan:
    """``plan`` with one step's new constexprs, its bounds flag and grid made to agree with its tiles."""
    step = plan.steps[role]
    length = plan.lengths[roles.owned_length]
    constexprs[roles.owned_even] = length % constexprs[roles.owned] == 0
    grid = (cdiv(length, constexprs[roles.owned]),) + tuple(step.grid[1:])
    return plan._replace(steps={**plan.steps, role: step._replace(grid=grid, constexprs=constexprs)})


# [Note] Tiles the compiler made costly. Default tiles are chosen before the mods are compiled, and
# a mod that gathers per pair can make them slow in two ways the compiler reports once the first
# call has run (correct, if slow). Later calls of the problem then get a cheaper plan, one step per
# call and kernel, until neither holds; tiles pinned by kernel_options or chosen by AUTOTUNE are kept.
# 1. Spills: more than SPILL_LIMIT_BYTES of local memory per thread halves the walked tile, then the
#    owned tile (not below 32).
# 2. Staged gathers: shared memory beyond the owned tile and one walked tile per stage by
#    STAGED_GATHER_BYTES or more means the software pipeliner buffers the mods' gathered tiles
#    too: one stage fewer, down to one.
# Why these two rules and their limits: a census of the 22 catalogue entries at their default tiles
# (forward and backward, d=64 and 128; benchmarks/tile_census.py) found that they change a handful of
# kernels (the Longformer, Graphormer and T5 ones that spill, or whose gathers the pipeliner stages),
# every one of them faster, while halving the key tile of kernels that spill only a few bytes made
# them slower. Numbers: docs/benchmarks_log.md, "Forward: default tiles replaced when the compiler
# made them costly (2026-11-24)" and "Backward: default tiles replaced when the compiler made them
# costly (2026-11-25)".
SPILL_LIMIT_BYTES = 100
STAGED_GATHER_BYTES = 32 * 1024


def _tile_bytes(c: dict, roles: TileRoles, elem_bytes: int) -> int:
    """The owned tile once and one walked tile per pipeline stage, as the kernel stages them."""
    owned = c[roles.owned] * sum(c[name] for name in roles.owned_width)
    walked = c[roles.walked] * sum(c[name] for name in roles.walked_width) * max(1, c["num_stages"])
    return (owned + walked) * elem_bytes


_PLANS_PER_KERNEL = 256

# [Note] Prepared eager launches. A warm eager call of a problem that ran before (the same plan key:
# shapes, strides, dtypes, device, BLOCK_SIZE, table statistics, outputs, options) launches what
# the long way worked out for it once: the outputs' layouts and the launch's ints, without
# re-deriving them or going through ``_run``. Each family keeps one PreparedLaunch per plan key
# (``KernelFamily._prepared``, bounded), made after a call ran the long way, and
# ``_prepared_result`` runs it while its ``serves`` says the call launches exactly what the long
# way would. A key leaves out what the family's plan does not depend on but its launch does; those
# facts are compared at every call instead, here for every family:
# - the plan itself: the key's plan may have been replaced since (resource fallback, the replan
#   rule, eviction), so the entry serves only while it is the very plan the family keeps;
# - the scale's value (the key holds its sign): a launch argument; 0.0 and -0.0 compare equal and
#   are different SM_SCALE arguments, so they are told apart;
# - kernels compiled ahead: a recording call takes the long way, which records;
# and in each family's ``also_serves``, what its own key leaves out (each family's module says what).
# Nothing of a call's tensors is kept: the tables and the mods' captured values are the call's
# own, read again at each call (the tables' content through launch_tables' stamps; a captured
# tensor replaced by another or changed in place is read as it is then; a Python number a mod
# reads comes in ``score_captured``), and a freed tensor whose id comes back finds nothing of its
# own. No device buffer is kept in a prepared launch either: each call allocates as the long way
# does, under the same rules for CUDA-graph captures and side streams (flexattn/cuda_graphs.py; the
# decode's split scratch is kept per thread and stream by those rules, [Note] Kept scratch in
# kernels/launch.py, on both ways alike). Every launch still goes through ``launch``, which takes
# Triton's specialisation facts (alignment, dtypes of the mods' tensors, the mods' numbers) from
# each call's arguments. A prepared launch the compiler refuses (out of resources) is dropped,
# and the call takes the long way, which steps down ([Note] Resource fallback).
_PREPARED_KEPT = 256


class PreparedLaunch:
    """What a family's prepared launch has besides its own work ([Note] Prepared eager launches):
    the ``plan`` it launches and the ``scale`` it was prepared for, set by the family's subclass,
    which also implements ``run(problem)`` (the call's result) and may add ``also_serves``."""

    plan: Plan
    scale: float

    def serves(self, plan: Optional[Plan], problem: Problem) -> bool:
        """Whether this call, whose key's plan is ``plan``, launches exactly what the long way would."""
        scale = problem.scale
        if plan is not self.plan or recording() or scale != self.scale:
            return False
        if not scale and math.copysign(1.0, scale) != math.copysign(1.0, self.scale):
            return False  # 0.0 and -0.0 are equal, and are different SM_SCALE arguments
        return self.also_serves(problem)

    def also_serves(self, problem: Problem) -> bool:
        """What the family's own key leaves out, checked for this call."""
        return True

    def run(self, problem: Problem):
        raise NotImplementedError


class KernelFamily:
    """The kernels of one family for one pair of traced mods (see [Note] Cache keys): one compiled
    source per lowering variant and a bounded table of launch plans, one per problem.

    A family says which template it renders (``kind``), how its tiles relate to its grids
    (``TILE_ROLES``, for the replan rule), and implements ``_smaller_plan`` (its step down when the
    GPU runs out of resources) and ``_resource_error``; ``_run`` does the rest."""

    kind: str = ""  # a key of codegen.FAMILIES
    TILE_ROLES: dict = {}  # role -> TileRoles, for the kernels the replan rule watches

    def __init__(self, score: Optional[TracedMod], mask: Optional[TracedMod], *, tanh_approx: bool):
        self.score, self.mask, self.tanh_approx = score, mask, tanh_approx
        self.has_score_mod = score is not None
        self.has_mask_mod = mask is not None
        self._compiled: dict[tuple, CompiledKernel] = {}
        self._plans: "OrderedDict[tuple, Plan]" = OrderedDict()
        self._prepared: dict = {}  # plan key -> PreparedLaunch ([Note] Prepared eager launches)
        self.prepared_calls = 0  # calls served by a prepared launch (tests check that warm calls take it)
        self.last_plan: Optional[Plan] = None  # what the latest call launched (tests and debugging read it)

    # ---------------------------------------------------------------- compiled sources
    def compiled(self, bounds=None) -> CompiledKernel:
        """The kernels for calls within ``bounds`` (an IndexBounds); None: correct at any lengths.
        From the kernel index when an earlier process rendered them ([Note] The kernel index in
        codegen/source.py), else lowered and rendered now (and entered in the index)."""
        variants = lowering_variants(self.score, self.mask, bounds)
        compiled = self._compiled.get(variants)
        if compiled is None:
            key = self._index_key(variants)
            found = kernel_index.get(key) if key is not None else None
            if found is not None:
                record, source = found
                compiled = CompiledKernel(
                    source=source, source_digest=record["source_digest"],
                    module=load_kernel_module(source, record["readable_name"]), variants=variants,
                    readable_name=record["readable_name"], trainable=tuple(record["trainable"]),
                    make_spec=lambda: self._spec(variants))
            else:
                spec = self._spec(variants)
                source = render(spec)
                digest = hashlib.sha256(source.encode()).hexdigest()[:16]
                trainable = tuple(spec.score_grad.trainable) if spec.score_grad is not None else ()
                compiled = CompiledKernel(
                    source=source, source_digest=digest, module=load_kernel_module(source, spec.readable_name()),
                    variants=variants, readable_name=spec.readable_name(), trainable=trainable, lowered=spec)
                if key is not None:
                    kernel_index.put(key, {"stem": f"{spec.readable_name()}_{digest}", "source_digest": digest,
                                           "readable_name": spec.readable_name(), "trainable": list(trainable)})
            self._compiled[variants] = compiled
        return compiled

    def _index_key(self, variants: tuple) -> Optional[str]:
        """The kernel index's key of this family's source for ``variants``; None where the index
        cannot serve (a lowering table entry the user registered)."""
        if lowering_ops.user_entries:
            return None
        mods = tuple(None if m is None else m.content_text() for m in (self.score, self.mask))
        # A variant's repr is its decisions, stable across processes (not its graph hash).
        return kernel_index.key((self.kind, mods, repr(variants), self.tanh_approx))

    def _spec(self, variants: tuple) -> KernelSpec:
        """What the family's template takes: both mods lowered for ``variants``, and their names."""
        return KernelSpec(
            self.kind,
            score_mod=_lower(self.score, "sm_", self.tanh_approx, variants[0]),
            mask_mod=_lower(self.mask, "mm_", self.tanh_approx, variants[1]),
            score_name=self.score.name if self.score else "identity",
            mask_name=self.mask.name if self.mask else "none",
        )

    # ---------------------------------------------------------------- plans and launches
    def _prepared_result(self, key: tuple, problem: Problem):
        """The result of the prepared launch of ``key`` when it serves this call, else None: the
        call takes the long way (``_run``) ([Note] Prepared eager launches)."""
        prepared = self._prepared.get(key)
        if prepared is None or not prepared.serves(self._plans.get(key), problem):
            return None
        try:
            result = prepared.run(problem)
        except Exception as err:
            if not is_out_of_resources(err):
                raise
            self._prepared.pop(key, None)  # the long way steps down; pop: another thread may have dropped it
            return None
        if result is not None:  # None: run found the call outside what it prepared, and launched nothing
            self.prepared_calls += 1
        return result

    def _keep_prepared(self, key: tuple, prepared: PreparedLaunch) -> None:
        """``prepared`` for the later calls of ``key`` (the latest _PREPARED_KEPT keys)."""
        if len(self._prepared) >= _PREPARED_KEPT:
            self._prepared.clear()
        self._prepared[key] = prepared

    def _run(self, key: tuple, problem: Problem):
        """Launch the plan of problem ``key`` (made by ``_plan`` on first use, for the kernels
        ``compiled`` for its lengths) and return the result of ``_launch(used, problem) -> (result,
        kernels)``. ``_for_call(plan, problem)`` is the plan this call runs: ``plan`` itself, or a
        copy changed for this call's tensors (an unaligned view cannot take tensor descriptors).
        ``kernels`` maps each role in TILE_ROLES to its compiled kernel.

        [Note] Resource fallback: a mod with many per-pair gathers (a Graphormer edge bias summed
        over a path) can need more shared memory than the default tiles allow. The compiler says
        so at the first launch; the family's smaller plan is then kept for this problem and the
        launch runs again from fresh buffers, and only when no tile fits does the user see an
        error, ours. The replan rule ([Note] Tiles the compiler made costly) only learns from a
        call that ran the plan itself; a deterministic call (options.deterministic) runs again until
        its plan has settled, so that its first result has the same bits as every later one's."""
        plan = self._plans.get(key)
        if recording():  # [Note] Kernels compiled ahead: no plan kept, nothing learnt from compiling
            return self._launch(self._for_call(plan or self._new_plan(problem), problem), problem)[0]
        if plan is None:
            plan = self._remember_plan(key, self._new_plan(problem))
        options = problem.options
        settle = requested_determinism(options)
        while True:
            used = self._for_call(plan, problem)
            try:
                result, kernels = self._launch(used, problem)
            except Exception as err:
                if not is_out_of_resources(err):
                    raise
                smaller = self._smaller_plan(used, options)
                if smaller is None:
                    raise self._resource_error(used, err) from err
                self._plans[key] = plan = smaller
                continue
            self.last_plan = used
            if plan.check_compiled and used is plan:
                self._plans[key] = after = self._plan_after_compile(plan, kernels)
                if settle and after.check_compiled:  # other tiles: their sums run in another order
                    plan = after
                    continue
            return result

    def _new_plan(self, problem: Problem) -> Plan:
        """The family's plan for ``problem``, with the kernels compiled for its lengths (the
        lowering's decisions, such as int64 index arithmetic, made here once per plan, so warm
        calls pay nothing for them)."""
        return self._plan(problem, self.compiled(problem.bounds()))

    def _plan(self, problem: Problem, compiled: CompiledKernel) -> Plan:
        raise NotImplementedError

    def _for_call(self, plan: Plan, problem: Problem) -> Plan:
        return plan

    def _launch(self, plan: Plan, problem: Problem):
        raise NotImplementedError

    def _remember_plan(self, key: tuple, plan: Plan) -> Plan:
        self._plans[key] = plan
        if len(self._plans) > _PLANS_PER_KERNEL:  # masks rebuilt with new content must not pile up
            self._plans.popitem(last=False)
        return plan

    def _smaller_plan(self, plan: Plan, options: dict) -> Optional[Plan]:
        raise NotImplementedError

    def _resource_error(self, plan: Plan, err: Exception) -> ResourceError:
        raise NotImplementedError

    def _names(self) -> str:
        return (f"score_mod '{self.score.name if self.score else None}' and mask_mod "
                f"'{self.mask.name if self.mask else None}'")

    def _plan_after_compile(self, plan: Plan, kernels: dict) -> Plan:
        """The next plan after a default plan's kernels ran compiled (``kernels``: role -> the compiled
        kernel; see [Note] Tiles the compiler made costly): a cheaper one, or the same one marked seen."""
        has_mods = self.has_score_mod or self.has_mask_mod
        changed = plan
        for role, roles in self.TILE_ROLES.items():
            c, kernel = dict(plan.constexprs(role)), kernels[role]
            if spilled_bytes(kernel) > SPILL_LIMIT_BYTES and max(c[roles.walked], c[roles.owned]) > 32:
                c[roles.walked if c[roles.walked] > 32 else roles.owned] //= 2
                changed = with_tiles(changed, role, roles, c)
            elif (has_mods and c["num_stages"] > 1
                  and shared_bytes(kernel) - _tile_bytes(c, roles, plan.elem_bytes) >= STAGED_GATHER_BYTES):
                c["num_stages"] = c["NUM_STAGES"] = c["num_stages"] - 1
                changed = with_tiles(changed, role, roles, c)
        return plan._replace(check_compiled=False) if changed is plan else changed


def _lower(traced: Optional[TracedMod], prefix: str, tanh_approx: bool, variant) -> Optional[LoweredMod]:
    if traced is None:
        return None
    return lower(traced, prefix=prefix, tanh_approx=tanh_approx, variant=variant)


def _import_triton() -> ModuleType:
    try:
        return importlib.import_module("triton")
    except ImportError as err:
        missing = getattr(err, "name", None)
        if missing is None or missing == "triton" or missing.startswith("triton."):
            raise BackendUnavailableError(
                "the Triton backend needs the 'triton' package (pip install triton); "
                "use kernel_options={'BACKEND': 'PYTORCH'} to run without it"
            ) from err
        needs = " (Triton's interpreter, TRITON_INTERPRET=1, imports it)" if interpreter_enabled() else ""
        raise BackendUnavailableError(
            f"triton is installed but importing it failed: {err}. It needs the module '{missing}'{needs}: "
            f"pip install {missing}; or use kernel_options={{'BACKEND': 'PYTORCH'}} to run without Triton"
        ) from err


_KERNELS_KEPT = 256


def cached_kernel(table: OrderedDict, family: type, score: Optional[TracedMod], mask: Optional[TracedMod],
                  tanh_approx: bool):
    """``family(score, mask, tanh_approx=...)`` from ``table``, built on first use and kept (the latest
    _KERNELS_KEPT). The key holds the TracedMods themselves (see [Note] Cache keys)."""
    key = (score, mask, tanh_approx)
    kernel = table.get(key)
    if kernel is None:
        _import_triton()
        kernel = table[key] = family(score, mask, tanh_approx=tanh_approx)
        if len(table) > _KERNELS_KEPT:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return kernel
