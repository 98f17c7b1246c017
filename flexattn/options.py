"""Plain-value options of the public API: kernel options and the auxiliary-output request."""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional, TypedDict

import torch

__all__ = ["FlexKernelOptions", "AuxRequest", "AuxOutput", "resolve_backend_name", "normalize_kernel_options",
           "deterministic"]


class FlexKernelOptions(TypedDict, total=False):
    """Options for ``flex_attention(..., kernel_options=...)``. Every key is optional.

    torch's keys are accepted too, so code written for ``torch.nn.attention.flex_attention`` runs
    unchanged: a ``fwd_`` prefix (``fwd_BLOCK_M``, ``fwd_num_warps``, ...) sets the forward's key of
    that name and wins over the plain one, and ``bwd_num_warps`` / ``bwd_num_stages`` set the
    backward's; other ``bwd_`` keys, and torch's keys that mean nothing here (listed last below,
    each with why), are ignored, and the first call that passes one warns
    once per process with the list. Any other key is an error.

    Like torch's, these options carry no backward-compatibility promise yet.
    """

    BACKEND: Literal["AUTO", "TRITON", "GLUON", "TRITON_DECODE", "PYTORCH"]
    """Which implementation runs. ``AUTO`` (default): the Triton kernels for CUDA tensors (the
    split-KV decode kernels for queries of up to 64 rows when no gradient is needed, the forward
    and backward kernels otherwise, as the Hopper Gluon kernels where they apply), the blockwise
    PyTorch path for other devices. ``TRITON``: the portable fused forward and backward kernels, or
    an error saying why they cannot run (on CPU tensors they need ``TRITON_INTERPRET=1``).
    ``GLUON``: the Hopper forward and backward written in Triton's Gluon (a loader warp and two
    consumer warpgroups), or an error saying why a call cannot take them: they need compute
    capability 9.0 (H100, H200), Triton 3.6 to 3.9, float16 or bfloat16, equal head dims of 64 or 128,
    query and key lengths that are multiples of 128, a BlockMask ``BLOCK_SIZE`` of 128, and mods
    Gluon compiles; the forward no ``max_scores``; the backward no learnable captured tensors and no
    broadcast key/value batch. AUTO takes them for such calls except where measured slower: the
    forward at head dim 64 with both a score_mod and a mask_mod, or on rows that visit fewer than 24
    key blocks; and not when a tile option of the portable kernel (``BLOCK_M``, ``BLOCK_M1``,
    ``num_warps``, ...) is set. ``flexattn kernel NAME --explain`` says which a call takes and why.
    ``TRITON_DECODE``: the split-KV decode kernels (flash-decoding: the KV sequence split across
    programs, all query heads of a GQA group in one tile), for queries that fit in one query block
    of the BlockMask; an error otherwise. Calls that need gradients or ``max_scores`` run the
    forward kernel instead (the decode kernels are for inference). ``PYTORCH``: the blockwise
    online-softmax path in plain PyTorch (any device, forward and backward)."""

    BLOCK_M: int
    """Query rows per Triton program. Must divide the BlockMask's query block size. The decode
    kernels ignore it (their tile holds a GQA group's query rows); they take ``BLOCK_N``,
    ``num_warps`` and ``num_stages``."""

    BLOCK_N: int
    """Key columns per inner-loop step. Must divide the BlockMask's key block size."""

    num_warps: int
    """Warps per Triton program, forward and backward (``fwd_num_warps`` / ``bwd_num_warps`` set
    one pass only)."""

    num_stages: int
    """Software-pipelining depth of the inner loops, forward and backward (``fwd_num_stages`` /
    ``bwd_num_stages`` set one pass only)."""

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
    GPUs (relative error about 2^-11). Default: on for float16/bfloat16/FP8 inputs on NVIDIA GPUs, where
    that error is below the inputs' own rounding; off (an exact tanh) for float32 and elsewhere."""

    DECODE_NUM_SPLITS: int
    """Decode kernels only (flexattn's own key): how many programs share each row's key blocks.
    Default: enough for about four programs per SM, with at least 512 keys each (one or two under
    the interpreter)."""

    FORCE_USE_FLEX_ATTENTION: bool
    """``True``: never pick the decode kernels automatically; short queries run the forward kernel
    (torch's name and meaning). Cannot be combined with ``BACKEND='TRITON_DECODE'``."""

    CHECK_INDICES: bool
    """Debug mode: before running, evaluate the score_mod and mask_mod with torch over every
    ``(b, h, q_idx, kv_idx)`` of the call (tile by tile, on the query's device) and raise an
    ``InvalidInputError`` naming the mod, the tensor, the index and one position where a gather
    reads outside a captured tensor (torch would raise an IndexError there; every backend reads 0).
    Slow: for finding a bug, not for training. The environment variable
    ``FLEXATTN_CHECK_INDICES=1``, read when flexattn is imported, turns it on for every call
    that does not set this option."""

    DETERMINISTIC: bool
    """Triton backward: the gradients of learnable captured tensors are summed in a fixed order, so
    that two runs on the same inputs give the same bits (dQ, dK and dV are each written by one
    program, or on Hopper dQ's parts are added in a fixed order; a deterministic call also launches
    again until its problem's tiles have settled).
    Default: ``torch.are_deterministic_algorithms_enabled()``, set by
    ``torch.use_deterministic_algorithms(True)``, which also covers the PyTorch backend's ops. The
    cost is a float32 copy of each learnable tensor's gradient per program (fewer copies, taken in
    turn, past 256 MiB a tensor, but never fewer than four per multiprocessor) and, where several
    pairs of one tile read one element, a tile sum per distinct element."""

    # -- torch's keys that flexattn accepts and ignores (see the class docstring).

    PRESCALE_QK: bool
    """Ignored. The kernel already keeps the softmax scale in float32 and folds it into the
    exponent wherever no score_mod needs the scaled score, which is what pre-scaling buys in torch,
    without rounding a pre-scaled 16-bit query a second time."""

    ROWS_GUARANTEED_SAFE: bool
    """Ignored: flexattn always guards fully masked rows, at no measurable cost, so a wrong promise
    cannot produce NaN."""

    BLOCKS_ARE_CONTIGUOUS: bool
    """Ignored: the launcher reads from the BlockMask itself whether each row's blocks are
    consecutive, so a wrong promise cannot skip or repeat blocks."""

    BLOCK_M1: int
    """Backward, dK/dV kernel: query rows walked per step. A power of two >= 16 that divides the
    BlockMask's query block size (torch's name and meaning)."""

    BLOCK_N1: int
    """Backward, dK/dV kernel: key rows owned by each program (divides the key block size)."""

    BLOCK_M2: int
    """Backward, dQ kernel: query rows owned by each program (divides the query block size)."""

    BLOCK_N2: int
    """Backward, dQ kernel: key rows walked per step (divides the key block size)."""

    WRITE_DQ: bool
    """Ignored (a choice inside torch's backward kernel: flexattn always forms dQ)."""

    kpack: int
    """Ignored (ROCm)."""

    matrix_instr_nonkdim: int
    """Ignored (ROCm)."""

    waves_per_eu: int
    """Ignored (ROCm)."""


def _with_option_docs(cls: type) -> type:
    """Append each option's description to the class docstring, so ``help(FlexKernelOptions)`` and
    IDEs show them: Python keeps no docstrings for TypedDict keys, so they are read from this file."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError, SyntaxError):  # no source (a frozen build): the class doc alone
        return cls
    body = tree.body[0].body
    lines = ["", "Options:", ""]
    for node, following in zip(body, body[1:]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if not (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            continue
        lines.append(f"{node.target.id}: {ast.unparse(node.annotation)}")
        lines.extend("    " + line for line in inspect.cleandoc(following.value.value).splitlines())
        lines.append("")
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n" + "\n".join(lines)
    return cls


FlexKernelOptions = _with_option_docs(FlexKernelOptions)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs ``flex_attention(..., return_aux=AuxRequest(...))`` returns."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """Auxiliary outputs: ``lse`` [B, Hq, L] and ``max_scores`` [B, Hq, L], natural-log scale,
    float32 (float64 for float64 inputs); a field is None unless it was requested."""

    lse: Optional[torch.Tensor] = None
    max_scores: Optional[torch.Tensor] = None


_BACKENDS = ("AUTO", "TRITON", "GLUON", "TRITON_DECODE", "PYTORCH")


def resolve_backend_name(kernel_options: Optional[dict]) -> str:
    backend = (kernel_options or {}).get("BACKEND", "AUTO")
    if backend not in _BACKENDS:
        raise ValueError(f"kernel_options['BACKEND'] must be one of {_BACKENDS}, got {backend!r}")
    return backend


# Keys that set the forward kernel (a ``fwd_`` prefix may name them), and torch's keys that mean
# nothing here: accepted, reported once, dropped before they reach a cache key.
# Keys a ``bwd_`` prefix may name: launch sizes shared with the forward (kept as ``bwd_X``), and the
# backward's own tiles (``bwd_BLOCK_M1`` is ``BLOCK_M1``).
BACKWARD_PREFIXED = frozenset({"num_warps", "num_stages"})
BACKWARD_TILES = frozenset({"BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"})
FORWARD_OPTIONS = frozenset(
    {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "AUTOTUNE", "USE_TMA", "HOST_DESCRIPTORS", "WARP_SPECIALIZE",
     "TANH_APPROX"}
)
KNOWN_OPTIONS = frozenset(FlexKernelOptions.__annotations__)
_BACKWARD = "not a backward option: the backward's tiles are BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2"
_ROCM = "no ROCm tuning"
IGNORED_BECAUSE = {
    "PRESCALE_QK": "the scale is already folded into the exponent",
    "ROWS_GUARANTEED_SAFE": "fully masked rows are always guarded",
    "BLOCKS_ARE_CONTIGUOUS": "read from the BlockMask itself",
    "WRITE_DQ": "flexattn always forms dQ",
    "kpack": _ROCM, "matrix_instr_nonkdim": _ROCM, "waves_per_eu": _ROCM,
}


def why_ignored(key: str) -> str:
    if key.startswith("bwd_"):
        return _BACKWARD
    if key.startswith("fwd_"):
        return IGNORED_BECAUSE.get(key[4:], "not a forward option")
    return IGNORED_BECAUSE[key]
IGNORED_OPTIONS = frozenset(IGNORED_BECAUSE)
_USED_AS_GIVEN = KNOWN_OPTIONS - IGNORED_OPTIONS


def normalize_kernel_options(options: dict) -> tuple[dict, list[str], list[str]]:
    """``(options flexattn uses, ignored keys, unknown keys)``: ``fwd_X`` becomes ``X`` (and wins
    over a plain ``X``); torch's keys that mean nothing here, and every ``bwd_`` key of a known
    name, are ignored."""
    if options.keys() <= _USED_AS_GIVEN:
        return options, [], []  # the common case, checked in one set operation
    used, prefixed, ignored, unknown = {}, {}, [], []
    for key, value in options.items():
        if key in _USED_AS_GIVEN:
            used[key] = value
        elif key in IGNORED_OPTIONS:
            ignored.append(key)
        elif key.startswith("fwd_") and key[4:] in FORWARD_OPTIONS:
            prefixed[key[4:]] = value
        elif key.startswith("bwd_") and key[4:] in BACKWARD_PREFIXED:
            used[key] = value  # read by the backward's launcher as it is (kernels/configs.py)
        elif key.startswith("bwd_") and key[4:] in BACKWARD_TILES:
            prefixed[key[4:]] = value
        elif key.startswith(("fwd_", "bwd_")) and key[4:] in KNOWN_OPTIONS:
            ignored.append(key)  # bwd_ of anything, or fwd_ of a key that is not the forward's
        else:
            unknown.append(key)
    for key in BACKWARD_PREFIXED & prefixed.keys():
        # fwd_num_warps sets the forward alone: the backward keeps the plain key's value, or its default (None).
        used.setdefault(f"bwd_{key}", options.get(key))
    used.update(prefixed)
    return used, ignored, unknown


def deterministic(options: Optional[dict]) -> bool:
    """Whether a call must give the same bits for the same inputs: kernel option ``DETERMINISTIC``,
    else torch's switch (``torch.use_deterministic_algorithms``)."""
    if options and "DETERMINISTIC" in options:
        return bool(options["DETERMINISTIC"])
    return torch.are_deterministic_algorithms_enabled()
