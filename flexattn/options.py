"""Plain-value options of the public API: kernel options and the auxiliary-output request."""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional, TypedDict

import torch

__all__ = ["FlexKernelOptions", "AuxRequest", "AuxOutput", "resolve_backend_name"]


class FlexKernelOptions(TypedDict, total=False):
    """Options for ``flex_attention(..., kernel_options=...)``. Every key is optional.

    Like torch's, these options carry no backward-compatibility promise yet.
    """

    BACKEND: Literal["AUTO", "TRITON", "PYTORCH"]
    """Which implementation runs. ``AUTO`` (default): the Triton kernel for CUDA tensors, the
    blockwise PyTorch path otherwise. ``TRITON``: the fused kernel, or an error saying why it cannot
    run (on CPU tensors it needs ``TRITON_INTERPRET=1``). ``PYTORCH``: the blockwise online-softmax
    path in plain PyTorch (any device, forward and backward)."""

    BLOCK_M: int
    """Query rows per Triton program. Must divide the BlockMask's query block size."""

    BLOCK_N: int
    """Key columns per inner-loop step. Must divide the BlockMask's key block size."""

    num_warps: int
    """Warps per Triton program."""

    num_stages: int
    """Software-pipelining depth of the key loop."""

    AUTOTUNE: bool
    """Time a small set of launch configurations on the first call for each shape class and keep the
    fastest; the choice is saved in the cache directory and reused by later processes."""

    USE_TMA: bool
    """Move Q, K, V and the output through tensor descriptors (the Hopper copy engine). Used only
    where the layout allows it (unit last stride, 16-byte aligned rows) on compute capability 9.0
    or newer. Default: on there for 16-bit inputs, except for masks whose rows visit few blocks and
    for small problems, where pointer loads are faster."""

    HOST_DESCRIPTORS: bool
    """With ``USE_TMA``: build the tensor descriptors on the host, once per call, instead of in
    every program. Default: on for head dims up to 64 and for masks whose rows visit few blocks,
    where each program's own descriptor set-up costs up to 10%, in kernels of 2^28 scores or more
    (building them adds about 25 us of host time a call); off for long rows at head dim 128, where
    Triton loads the host-built (4-D) descriptors more slowly."""

    WARP_SPECIALIZE: bool
    """Hand the key loop to Triton's warp specialisation (loader and compute warp groups). Default:
    on only where flexattn validated it (Hopper, Triton 3.6, head dim 128, no mods, key length a
    multiple of the block). ``True`` extends it to other head dims, tile shapes and Triton
    versions, for experiments. Kernels with a score_mod or mask_mod, calls that need the row
    maxima, and calls that need the LSE of a query length that is not a multiple of 4 never get
    it: Triton 3.6 computed wrong results there."""

    TANH_APPROX: bool
    """Lower ``torch.tanh`` in score_mods to the hardware ``tanh.approx.f32`` instruction on NVIDIA
    GPUs (relative error about 2^-11). Default: on for float16/bfloat16 inputs on NVIDIA GPUs, where
    that error is below the inputs' own rounding; off (an exact tanh) for float32 and elsewhere."""

    ROWS_GUARANTEED_SAFE: bool
    """Accepted for compatibility with torch and ignored: flexattn always guards fully masked rows,
    at no measurable cost, so a wrong promise cannot produce NaN."""


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` returns."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """Auxiliary outputs: ``lse`` [B, Hq, L] and ``max_scores`` [B, Hq, L], natural-log scale,
    float32 (float64 for float64 inputs); a field is None unless it was requested."""

    lse: Optional[torch.Tensor] = None
    max_scores: Optional[torch.Tensor] = None


_BACKENDS = ("AUTO", "TRITON", "PYTORCH")


def resolve_backend_name(kernel_options: Optional[dict]) -> str:
    backend = (kernel_options or {}).get("BACKEND", "AUTO")
    if backend not in _BACKENDS:
        raise ValueError(f"kernel_options['BACKEND'] must be one of {_BACKENDS}, got {backend!r}")
    return backend
