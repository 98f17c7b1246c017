"""The generated Triton source of a variant's kernels, as the runtime would compile them for a call.

The mods are traced (``flexattn.trace.trace_mod``) and handed to the same kernel families a call
uses (``forward_kernel``, ``backward_kernel``, ``decode_kernel``), whose ``compiled(bounds)`` lowers
and renders for a call of these sizes: the lengths decide the lowering (int32 or int64 index
arithmetic), so the source printed is the one a call at these sizes runs.
"""

from __future__ import annotations

from typing import Callable, Optional

from flexattn.kernels import backward_kernel, decode_kernel, forward_kernel
from flexattn.lowering import index_bounds
from flexattn.trace import trace_mod

__all__ = ["KINDS", "kernel_source"]

KINDS = ("forward", "backward", "decode")


def kernel_source(score_mod: Optional[Callable], mask_mod: Optional[Callable], B: int, H: int, Q_LEN: int,
                  KV_LEN: int, kind: str = "forward", *, tanh_approx: bool = False) -> str:
    """The Triton source of the ``kind`` kernels for these mods at these sizes (rendering and
    importing the module, as the first call would; nothing is launched). ``tanh_approx``: the
    hardware tanh that flexattn picks for 16-bit inputs on NVIDIA GPUs."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    score = trace_mod(score_mod, "score_mod")[0] if score_mod is not None else None
    mask = trace_mod(mask_mod, "mask_mod")[0] if mask_mod is not None else None
    family = {"forward": forward_kernel, "backward": backward_kernel, "decode": decode_kernel}[kind]
    return family(score, mask, tanh_approx=tanh_approx).compiled(index_bounds(B, H, Q_LEN, KV_LEN)).source
