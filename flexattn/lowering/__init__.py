"""Lowering: a traced score_mod / mask_mod (an aten fx graph) becomes Triton source.

Stage 2 of the pipeline (trace -> lowering -> codegen -> kernels)::

    traced, captured_values = trace_mod(alibi, "score_mod")
    lowered = lower(traced, ModInputs(), prefix="sm_")
    lowered.lines          # ('sm_t0 = ...',) statements to paste at the kernel's hook point
    lowered.result         # 'qk + tl.load(sm_slopes_ptr + off_hq * sm_slopes_stride0) * ...'
    lowered.kernel_params  # ('sm_slopes_ptr', 'sm_slopes_stride0')

ops.py holds the table (one small function per aten op), emit.py the walk over the graph (values.py
the values it makes, gathers.py its reads of captured tensors, calls.py one op node), index.py
the sympy integer arithmetic for indices, gradient.py the score_mod's derivative, ranges.py the
integer ranges at a call's lengths (int32 or int64, which gathers need guards), sites.py the user's
source line of a node, and check.py the CHECK_INDICES debug mode. The helpers the generated source
calls (py_floordiv, precise_tanh, ...) are in templates/mod_helpers.py.jinja.
"""

from .check import check_indices
from .emit import LoweredMod, ModInputs, lower
from .gradient import LoweredScoreGrad, lower_score_grad
from .ops import LOWERINGS, register_lowering
from .ranges import (
    IndexBounds, LoweringVariant, index_bounds, index_dtype, lowering_variant, lowering_variants, mod_index_dtype,
    needs_wide_indices,
)

__all__ = [
    "LoweredMod",
    "ModInputs",
    "lower",
    "LoweredScoreGrad",
    "lower_score_grad",
    "register_lowering",
    "LOWERINGS",
    "IndexBounds",
    "LoweringVariant",
    "lowering_variant",
    "needs_wide_indices",
    "index_bounds",
    "lowering_variants",
    "index_dtype",
    "mod_index_dtype",
    "check_indices",
]
