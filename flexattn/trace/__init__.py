"""Tracing: a score_mod or mask_mod callable becomes an aten-level torch.fx graph.

Stage 1 of the pipeline (trace -> lowering -> codegen -> kernels). It imports no Triton.

The mod is run once on 0-d tensors under a recording dispatch mode (record.py), so every torch call
is recorded as an aten op and any use of a tensor's *value* in Python (``if score > 0``, ``.item()``,
``int(q_idx)``) fails at trace time instead of silently baking one branch into the kernel.
docs/tracing.md says why we chose this over ``torch.fx.symbolic_trace``, ``make_fx`` and Dynamo.

Everything the mod can read (through closure cells, defaults, globals, helper functions, objects,
modules and nn.Modules) is found by searching the callable (reads.py), and what can change between
calls is *lifted*: each tensor becomes a graph input after the mod's own arguments, and so does each
Python number (numbers.py), so the same graph and the same kernels serve every call whatever the
current values, and gradients reach captured tensors that require grad. Graphs are cached by the
content of everything the mod can read (cache.py; [Note] Cache keys in reads.py); a warm call with
the same callable object re-reads the locations its last search read instead of searching again.

The homes: traced.py (what tracing gives: TracedMod), reads.py (what a callable reads), numbers.py
(numbers as inputs), record.py (recording the graph; the modes that evaluate mods with torch),
cache.py (``trace_mod`` and its caches).
"""

from .cache import trace_mod, with_stand_ins, with_values
from .numbers import TracedNumber
from .record import GathersReadZero, GetItemToIndex, gather_or_zero
from .traced import (
    INDEX_DTYPE, MASK_MOD_ARGS, NUMBER_INT_LIMIT, SCORE_DTYPE, SCORE_MOD_ARGS, CapturedInput, CapturedNumber,
    TracedMod, counts, detached, needs_grad,
)

__all__ = [
    "SCORE_MOD_ARGS",
    "MASK_MOD_ARGS",
    "INDEX_DTYPE",
    "SCORE_DTYPE",
    "CapturedInput",
    "CapturedNumber",
    "NUMBER_INT_LIMIT",
    "TracedMod",
    "TracedNumber",
    "trace_mod",
    "with_stand_ins",
    "with_values",
    "counts",
    "needs_grad",
    "detached",
    "GetItemToIndex",
    "GathersReadZero",
    "gather_or_zero",
]
