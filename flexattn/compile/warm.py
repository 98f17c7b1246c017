"""Warm calls of the ops: the first call of a problem decides (backend, kernel, plan) and the later
calls of the same problem launch what it kept, skipping the decisions ([Note] Warm calls of the
forward op, [Note] Warm calls of the backward op). A problem's key is everything those decisions
read; the entries hold the mask's kept record (compile/kept.py) weakly."""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch

from ..cuda_graphs import capturing, stream_key
from ..dispatch import Call, backward_relaunch, forward_relaunch
from ..kernels import interpreter_enabled
from ..kernels.tables import BACKWARD_TABLES, LaunchTables, RowStats, launch_tables
from ..trace import TracedMod
from .kept import current_record, kept_record, same_objects, weak_refs

__all__ = ["warm_key", "warm_forward", "remember_forward", "warm_backward", "remember_backward"]


# [Note] Warm calls of the forward op. A compiled step calls the op once per layer with the same
# problem: the same mods and options (the call key), the same shapes, strides and dtypes, the same
# BlockMask tables. The first call decides (backend, Gluon or portable kernel, the plan) and prepares
# the backward, which costs more host time than a layer's kernels take on the GPU, so the host fell
# behind in the forward of the first layers (measured: docs/benchmarks_log.md, "Warm calls of the
# forward op, and where a compiled block's host time goes"). Later calls of that problem launch the
# kept plan directly: new outputs, new descriptors, the launch. What a call's decisions read is its
# key (``forward_problem`` in compile/ops.py):
# * everything the op passes but the tensors' contents: the call key, lengths, block sizes, scale,
#   needs_grad and need_max, and for q, k, v and each captured tensor its shape, strides, dtype,
#   device, requires_grad and whether its address is 16-byte aligned (tensor descriptors need it);
# * the tables by identity, version counter, address, shape and strides: the launch's row
#   statistics (the consecutive-block flags change the kernel's results) were found for those very
#   tables at that version (kept or checked, [Note] What a compiled call's mask derives, kept). A
#   table freed and another made at the same id() is told apart by a weak reference to the first
#   (``_WarmTables.holds``); a table written in place has a new version: the call goes the long
#   way, and makes its own entry;
# * the process state the choices read: the interpreter switch, float32 matmul precision, torch's
#   determinism switch.
# None inside a CUDA-graph capture: its replays must read the tables as they are then, with no
# consecutive-block flags or transposed tables found before it (kernels/tables.py [Note] Tables read
# at each replay).
# Only a call that launched one settled plan of the portable or Gluon forward is kept (forward_relaunch
# in dispatch.py); the captured tensors' contents are read at launch, so new contents need no new entry.
_WARM: dict = {}  # problem -> _WarmForward
_WARM_KEPT = 512  # cleared when full: a new entry costs one call the long way


class _WarmTables(NamedTuple):
    """What a warm entry (forward or backward) keeps of its first call's tables and mods."""

    refs: tuple  # weak references to the op's four tables (None where absent)
    stats: RowStats  # what the first call's launch found in them
    has_full: bool
    plan_key: tuple
    score: Optional[TracedMod]
    mask: Optional[TracedMod]

    def holds(self, tables) -> bool:
        return same_objects(self.refs, tables)

    def arguments(self, tables, score_values, mask_values) -> tuple:
        """``(launch tables, the score_mod's captured values, the mask_mod's)`` of a warm launch:
        the op's tables as the launch reads them, with what the first call found for them."""
        nb, idx, fnb, fidx = tables
        full = self.has_full
        launch = LaunchTables(nb, idx, fnb if full else nb, fidx if full else idx, full, self.stats, self.plan_key)
        return launch, score_values, mask_values


def _warm_tables(call: Call, tables) -> Optional[_WarmTables]:
    """The tables' part of a warm entry, from the launch that just ran; None when it read copies of
    the op's tables (tables made contiguous or reordered), not the tables themselves."""
    launched = launch_tables(call.block_mask)  # derived by that launch
    nb, idx, fnb, fidx = tables
    if not (launched.kv_num_blocks is nb and launched.kv_indices is idx and launched.has_full == (fnb is not None)
            and (fnb is None or (launched.full_kv_num_blocks is fnb and launched.full_kv_indices is fidx))):
        return None
    return _WarmTables(weak_refs(tables), launched.stats, launched.has_full, launched.plan_key, call.score, call.mask)


def _keep_warm(entries: dict, problem: tuple, entry) -> None:
    if len(entries) >= _WARM_KEPT:
        entries.clear()
    entries[problem] = entry


class _WarmForward(NamedTuple):
    tables: _WarmTables
    relaunch: Callable
    walks_of: Optional[weakref.ref]  # a launch of program walks: the _Kept that holds the tables' walks

    def run(self, query, key, value, tables, score_values, mask_values):
        """``(out, lse, max or None)``, or None when the walks kept for the tables are gone (the long
        way then)."""
        arguments = self.tables.arguments(tables, score_values, mask_values)
        if self.walks_of is None:
            return self.relaunch(query, key, value, *arguments)
        kept = self.walks_of()
        if kept is None or kept.walks is None or current_record(tables[0]) is not kept:
            return None
        return self.relaunch(query, key, value, *arguments, walks=kept.walks)


def warm_forward(problem: tuple, query, key, value, tables, score_values, mask_values):
    """The warm launch of ``problem``: ``(out, lse, max or None)``, or None when there is none for
    these very tables or what it walked is gone (the long way then)."""
    warm = _WARM.get(problem)
    if warm is None or not warm.tables.holds(tables):
        return None
    return warm.run(query, key, value, tables, score_values, mask_values)


def warm_key(parts: list, tensors: tuple, tables: tuple, grad_flags: bool = True) -> Optional[tuple]:
    """``parts`` with the process state the choices read, the facts of each tensor (None allowed;
    ``grad_flags``: requires_grad among them, which the forward's choices read and the backward's
    do not) and the tables' identities: a key of [Note] Warm calls of the forward op and of the
    backward's."""
    if tables[0] is not None and capturing(tables[0]):
        return None  # a capture takes the long way: kernels/tables.py [Note] Tables read at each replay
    parts += [interpreter_enabled(), torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
              stream_key(tensors[0].device)]  # what a launch walks is kept per stream (kept.py)
    for t in tensors:
        parts.append(None if t is None else (t.shape, t.stride(), t.dtype, t.device, grad_flags and t.requires_grad,
                                             t.data_ptr() & 15))
    for t in tables:
        if t is not None and t.is_inference():
            return None  # no version counter to follow (masks/block_mask.py version_of)
        parts.append(None if t is None else (id(t), t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))
    return tuple(parts)


def remember_forward(problem: tuple, call: Call, query, key, value, tables, need_max: bool) -> None:
    warm_tables = _warm_tables(call, tables)
    relaunch = None if warm_tables is None else forward_relaunch(call, query, key, value, need_max)
    if relaunch is None:
        return
    walks_of = None
    if getattr(relaunch, "takes_walks", False):
        kept = kept_record(call.block_mask)
        if kept is None or kept.walks is None:
            return  # the walks could not be kept: later calls derive them, the long way
        walks_of = weakref.ref(kept)
    _keep_warm(_WARM, problem, _WarmForward(warm_tables, relaunch, walks_of))


# [Note] Warm calls of the backward op. The backward op is called once per layer with the same
# problem too, and its long way (the decisions, the transposed tables looked up, seven Gluon
# descriptors built and checked, three launches through Triton's own binding) put a compiled step's
# host time close to its GPU time, so any host slowness stalled the GPU (measured:
# docs/benchmarks_log.md, "Where the compiled steps' time goes, unprofiled: the power cap; warm
# backward calls"). Later calls of a problem launch what the first kept
# (``backward_relaunch`` in dispatch.py, the families' ``warm_launch``), keyed like the forward's
# ([Note] Warm calls of the forward op) on everything the op passes but the tensors' contents: q, k,
# v, the output, LSE, its gradient, dLSE and the captured tensors (shape, strides, dtype, device,
# alignment), the tables by identity and version, the process state (determinism included: it
# decides whether dQ is fused). Two more conditions: no captured tensor wants a gradient (those
# calls take the long way), and the transposed tables the first call walked are the ones kept for
# these tables ([Note] What a compiled call's mask derives, kept); the entry holds that record
# weakly and checks it is still the current one, so tables that died or changed never lend theirs.
_WARM_BACKWARD: dict = {}  # problem -> _WarmBackward


class _WarmBackward(NamedTuple):
    tables: _WarmTables
    kept: weakref.ref  # the _Kept whose transposed tables the first call walked
    relaunch: Callable

    def run(self, query, key, value, out, lse, grad_out, grad_lse, tables, score_values, mask_values):
        """``(dq, dk, dv)``, or None when the kept transposed tables are gone (the long way then)."""
        kept = self.kept()
        if kept is None or kept.backward is None or current_record(tables[0]) is not kept:
            return None
        launch, score, mask = self.tables.arguments(tables, score_values, mask_values)
        return self.relaunch(query, key, value, out, lse, grad_out, grad_lse, launch, kept.backward, score, mask)


def warm_backward(problem: tuple, query, key, value, out, lse, grad_out, grad_lse, tables, score_values,
                  mask_values):
    """The warm launch of ``problem``: ``(dq, dk, dv)``, or None (the long way then)."""
    warm = _WARM_BACKWARD.get(problem)
    if warm is None or not warm.tables.holds(tables):
        return None
    return warm.run(query, key, value, out, lse, grad_out, grad_lse, tables, score_values, mask_values)


def remember_backward(problem: tuple, call: Call, query, key, value, out, grad_out, grad_lse, tables) -> None:
    mask = call.block_mask
    kept = kept_record(mask)
    if kept is None or kept.backward is None or kept.backward is not mask.peek_derived(BACKWARD_TABLES):
        return  # the transposed tables this call walked are not kept (a capture, a graph tree's warm-up)
    warm_tables = _warm_tables(call, tables)
    relaunch = None if warm_tables is None else backward_relaunch(call, query, key, value, out, grad_out, grad_lse)
    if relaunch is not None:
        _keep_warm(_WARM_BACKWARD, problem, _WarmBackward(warm_tables, weakref.ref(kept), relaunch))

