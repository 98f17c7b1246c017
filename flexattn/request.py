"""The front door of every call: the checks and normalisation of what a call asks for, and the one
builder of the ``Call`` that dispatch.py runs.

Every entry goes through here: the eager ``flex_attention`` and its path under Dynamo (api.py), the
compiled op's bodies (compile/ops.py: ``build_call``; the checks ran when Dynamo traced the call) and
context parallelism (distributed/). So a bad input gives one error, with one message, whichever
entry it came through; copies of these checks drift apart, and a check goes missing on one path.

In the order an entry takes them:

1. ``check_tensors``: query, key and value, their dtypes, shapes and devices;
2. ``options_of``: ``kernel_options`` as flexattn uses them (torch's keys too);
3. ``request_of``: ``scale`` as a float, and what ``return_lse`` and ``return_aux`` ask for as
   ``Outputs``, which puts the results in that form (``Outputs.returned``);
4. ``check_block_mask``: the BlockMask fits the call;
5. ``captured_on``: each traced mod's captured values checked for the query's device, with the
   constants the mod builds itself copied there;
6. ``wants_grad`` and ``check_grad_dtypes``: whether the call needs a gradient, and the dtypes one needs;
7. ``build_call``: the backend, the decode kernels or not, the PyTorch backend's index dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch

from .dispatch import Call, choose_decode, pick_backend
from .errors import InvalidInputError
from .kernels.launch import FLOAT8_DTYPES
from .lowering import index_bounds, index_dtype
from .masks import BlockMask, sliced_rows_mask_mod, torch_counterpart
from .options import KNOWN_OPTIONS, AuxOutput, AuxRequest, normalize_kernel_options, why_ignored
from .trace import TracedMod, needs_grad

__all__ = ["Outputs", "check_tensors", "options_of", "request_of", "check_block_mask", "check_captured_devices",
           "captured_on", "wants_grad", "check_grad_dtypes", "build_call"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64) + FLOAT8_DTYPES


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


# ------------------------------------------------------------------------------------ the tensors


def check_tensors(query, key, value, enable_gqa: bool) -> None:
    """Query, key and value are 4-D float tensors on one device whose shapes fit together."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InvalidInputError(
                f"{name} must be 4-D [batch, heads, seq_len, head_dim], got shape {_shape(t)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise InvalidInputError(
                f"{name} must be float16, bfloat16, float32, float64, float8_e4m3fn or float8_e5m2 (FP8: forward "
                f"only), got {t.dtype}"
            )
    if not (query.device == key.device == value.device):
        raise InvalidInputError(
            f"query, key and value must be on one device, got {query.device}, {key.device} and {value.device}"
        )
    B, Hq, L, E = query.shape
    Bk, Hk, S, Ek = key.shape
    Bv, Hv, Sv, Ev = value.shape
    if (Bk, Hk, S) != (Bv, Hv, Sv):
        raise InvalidInputError(
            f"key and value must agree on batch, heads and seq_len, got key {_shape(key)} and value {_shape(value)}"
        )
    if Bk != B and Bk != 1:
        raise InvalidInputError(
            f"key/value batch must equal the query batch ({B}) or be 1 (broadcast), got {Bk}"
        )
    if Ek != E:
        raise InvalidInputError(f"query and key must have the same head_dim, got {E} (query) and {Ek} (key)")
    if Hk != Hq:
        # Divisibility first: enable_gqa=True cannot fix a head count that is not a multiple.
        if Hq % Hk != 0:
            raise InvalidInputError(
                f"query has {Hq} heads and key/value have {Hk}: grouped-query attention needs the query heads to be "
                f"a multiple of the key/value heads (query head h reads key/value head h // (Hq / Hkv)), and {Hq} "
                f"is not a multiple of {Hk}; give query and key/value the same number of heads, or key/value a "
                f"number of heads that divides {Hq} (with enable_gqa=True)"
            )
        if not enable_gqa:
            raise InvalidInputError(
                f"query has {Hq} heads and key/value have {Hk}; pass enable_gqa=True for grouped-query attention"
            )
    if min(L, S, E, Ev) == 0:
        raise InvalidInputError(
            f"empty inputs are not supported: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
        )


# ------------------------------------------------------------------------------------ options and outputs

_reported_ignored: set = set()  # torch's keys already named in a warning by this process


def options_of(kernel_options: Optional[dict]) -> dict:
    """``kernel_options`` as flexattn uses them (options.normalize_kernel_options); torch's keys that
    mean nothing here are named in one warning per process, unknown keys are an error. The warning
    points at the caller of the entry that calls this."""
    if kernel_options is None:
        return {}
    if not isinstance(kernel_options, dict):
        raise InvalidInputError(
            f"kernel_options must be a dict (FlexKernelOptions), got {type(kernel_options).__name__}")
    options, ignored, unknown = normalize_kernel_options(kernel_options)
    if unknown:
        raise InvalidInputError(
            f"unknown kernel_options {sorted(unknown)}; known options: {sorted(KNOWN_OPTIONS)}, each also with a "
            "fwd_ or bwd_ prefix (see flexattn.FlexKernelOptions)"
        )
    new = sorted(set(ignored) - _reported_ignored)
    if new:
        _reported_ignored.update(new)
        warnings.warn(
            "kernel_options accepted for compatibility with torch and ignored by flexattn (said once per process): "
            + ", ".join(f"{key} ({why_ignored(key)})" for key in new) + "; see flexattn.FlexKernelOptions",
            UserWarning, stacklevel=3,
        )
    return options


class Outputs(NamedTuple):
    """What a call returns, as its ``return_lse`` and ``return_aux`` asked."""

    need_lse: bool
    need_max: bool
    aux: Optional[AuxRequest]  # return_aux, as flexattn's AuxRequest
    return_lse: bool

    def returned(self, out, lse, max_scores):
        """The call's result: ``out``, ``(out, lse)`` or ``(out, AuxOutput)``."""
        if self.return_lse:
            return out, lse
        if self.aux is not None:
            return out, AuxOutput(lse=lse if self.aux.lse else None, max_scores=max_scores if self.need_max else None)
        return out


# The two that need no AuxRequest, made once rather than per call (a warm eager call's host time is
# a hot path): most calls ask for one of them.
_OUT = Outputs(False, False, None, False)
_OUT_AND_LSE = Outputs(True, False, None, True)


def request_of(query: torch.Tensor, scale, return_lse: bool, return_aux) -> tuple[float, Outputs]:
    """``(scale, outputs)``: a call's ``scale`` (None: ``1 / sqrt(head_dim)``) as a float and the
    ``Outputs`` its ``return_lse`` and ``return_aux`` ask for, checked. Dynamo traces it (api.py's
    path under torch.compile), where the deprecation warning of ``return_lse``, which it cannot
    trace, is left out."""
    if return_lse and return_aux is not None:
        raise InvalidInputError("pass either return_lse or return_aux, not both (return_lse is deprecated)")
    if return_lse and not torch.compiler.is_compiling():
        warnings.warn(
            "return_lse is deprecated, as in torch; use return_aux=AuxRequest(lse=True)", FutureWarning, stacklevel=3
        )
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        torch_request = torch_counterpart("AuxRequest")
        if torch_request is None or not isinstance(return_aux, torch_request):
            raise InvalidInputError(
                f"return_aux must be a flexattn.AuxRequest (or torch's AuxRequest), got {type(return_aux).__name__}"
            )
        return_aux = AuxRequest(lse=bool(return_aux.lse), max_scores=bool(return_aux.max_scores))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif isinstance(scale, (int, float)):
        scale = float(scale)
    else:
        raise InvalidInputError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if return_aux is not None:
        return scale, Outputs(bool(return_aux.lse), bool(return_aux.max_scores), return_aux, False)
    return scale, _OUT_AND_LSE if return_lse else _OUT


# ------------------------------------------------------------------------------------ the block mask


def check_block_mask(block_mask: BlockMask, query, key: Optional[torch.Tensor]) -> None:
    """The BlockMask (flexattn's, or torch's: the same fields) was built for this call's lengths
    (unless ``key`` is None: context parallelism's global mask, whose lengths are not a shard's) and
    fits its batch, heads and device."""
    B, Hq, L, _ = query.shape
    mask_q, mask_kv = block_mask.seq_lengths
    if key is not None and (mask_q, mask_kv) != (L, key.shape[2]):
        S = key.shape[2]
        if (query.shape[1], key.shape[1]) == (mask_q, mask_kv):
            raise InvalidInputError(
                f"query {_shape(query)} and key {_shape(key)} look like [batch, seq_len, heads, head_dim]: their "
                f"dim 1 matches the block_mask's Q_LEN={mask_q} and KV_LEN={mask_kv}. flex_attention takes "
                "[batch, heads, seq_len, head_dim], as torch's does: pass q.transpose(1, 2), k.transpose(1, 2) "
                "and v.transpose(1, 2), and transpose the output back with out.transpose(1, 2)"
            )
        if block_mask.mask_mod is sliced_rows_mask_mod:
            # Rows cut out of a full-length mask for a decoding step: cropping would keep the wrong
            # query positions; the step's mask needs the offset.
            fix = ("for a decoding step, build it with flexattn.decode_block_mask(full_mask, offset, q_len=...), "
                   "which also shifts the mask_mod to the step's positions")
        elif mask_q >= L and mask_kv >= S:
            fix = "call block_mask.adjust(new_q_len, new_kv_len) to crop it"
        else:
            fix = "create a new block mask for these lengths"
        raise InvalidInputError(
            f"block_mask was built for Q_LEN={mask_q}, KV_LEN={mask_kv} but query has seq_len {L} and key has "
            f"seq_len {S}; {fix}"
        )
    mb, mh = block_mask.kv_num_blocks.shape[:2]
    if mb not in (1, B) or mh not in (1, Hq):
        raise InvalidInputError(
            f"block_mask has batch {mb} and heads {mh}; they must be 1 (broadcast) or match the query "
            f"(batch {B}, heads {Hq})"
        )
    if block_mask.kv_num_blocks.device != query.device:
        raise InvalidInputError(
            f"block_mask is on {block_mask.kv_num_blocks.device} but query is on {query.device}; "
            "use block_mask.to(query.device) or create_block_mask(..., device=query.device)"
        )


# ------------------------------------------------------------------------------------ the mods' captured values


def check_captured_devices(traced: TracedMod, values: list, device: torch.device) -> None:
    """Each tensor the user's mod reads is on ``device`` (the query's)."""
    for captured, value in zip(traced.captured, values):
        if captured.walk_index is not None and value.device != device:
            raise InvalidInputError(
                f"{traced.kind} '{traced.name}' reads the tensor '{captured.name}' on {value.device}, but the "
                f"query is on {device}; create it on the query's device (e.g. {captured.name}.to('{device}'))"
            )


def captured_on(traced: Optional[TracedMod], values: list, device: torch.device) -> list:
    """A traced mod's captured values (tensors, then numbers) for a call on ``device``: the user's
    tensors checked (check_captured_devices), never moved; the constants the mod builds itself
    (frozen on the CPU when it was traced) on ``device`` (TracedMod.fixed_values_on: one copy per
    device, kept)."""
    if traced is None or not traced.captured:
        return values
    for captured, value in zip(traced.captured, values):  # check_captured_devices, inlined: every call runs it
        if captured.walk_index is not None and value.device != device:
            check_captured_devices(traced, values, device)  # raises, naming the tensor
    if device.type == "cpu" or all(c.walk_index is not None for c in traced.captured):
        return values
    fixed = traced.fixed_values_on(device)
    return [v if f is None else f for f, v in zip(fixed, values)] + list(values[len(fixed):])  # then the numbers


# ------------------------------------------------------------------------------------ gradients


def wants_grad(query, key, value, score_captured) -> bool:
    """Whether the call needs a gradient: grad mode is on and q, k, v or a tensor the score_mod
    reads requires one (a mask_mod's never take one)."""
    return torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
        or (len(score_captured) > 0 and needs_grad(score_captured))  # not bool(list): torch 2.11 Dynamo refuses it
    )


def check_grad_dtypes(query, key, value, grad: bool) -> None:
    """[Note] Mixed and FP8 dtypes. As in torch, the forward takes a key and value of another dtype than
    the query's (an FP8 cache with a bfloat16 query, say): the kernels convert them to the query's
    dtype as they load them, and the output is in the query's dtype. With an FP8 query, key and
    value both products run in FP8 (P is rounded to it too) and the output is FP8, as torch's is;
    per-tensor scales fold into ``scale`` (the query's and key's) and into the output (the value's).
    A gradient needs one dtype, and one that is not FP8: there is no FP8 backward, here or in torch."""
    if not grad:
        return
    if query.dtype in FLOAT8_DTYPES or key.dtype in FLOAT8_DTYPES or value.dtype in FLOAT8_DTYPES:
        raise InvalidInputError(
            f"FP8 inputs are forward-only (query {query.dtype}, key {key.dtype}, value {value.dtype}) and a gradient "
            "was asked for: run the call under torch.no_grad() or torch.inference_mode(), or pass bfloat16 or "
            "float16 tensors to train"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise InvalidInputError(
            f"query, key and value must have one dtype when a gradient is needed, got {query.dtype}, {key.dtype} "
            f"and {value.dtype}; {_dtype_fix(query, key, value)} (without gradients, key and value may have "
            "another dtype, which the kernels convert to the query's)"
        )


def _dtype_fix(query, key, value) -> str:
    """The conversion that gives query, key and value one dtype: the odd one out to the others'."""
    names = {"query": query.dtype, "key": key.dtype, "value": value.dtype}
    for name, dtype in names.items():
        others = {d for n, d in names.items() if n != name}
        if len(others) == 1 and dtype not in others:
            return f"convert {name}, e.g. {name}.to({others.pop()})"
    return "convert them to one, e.g. key.to(query.dtype) and value.to(query.dtype)"


# ------------------------------------------------------------------------------------ the Call


def build_call(query: torch.Tensor, kv_len: int, block_mask: BlockMask, score: Optional[TracedMod],
               mask: Optional[TracedMod], mask_captured: list, options: dict, scale: float, grad: bool,
               need_max: bool) -> Call:
    """The ``Call`` of a checked call with ``kv_len`` keys: the backend its options, device and dtype
    call for (the decode kernels where they apply), and the index dtype the PyTorch backend passes
    to the mods (int64 where their arithmetic needs it at these lengths)."""
    backend = pick_backend(query, options)
    wide = torch.int32
    if backend == "PYTORCH":
        B, Hq, L, _ = query.shape
        wide = index_dtype(score, mask, bounds=index_bounds(B, Hq, L, kv_len))
    elif backend in ("TRITON", "TRITON_DECODE"):
        backend = choose_decode(backend, options, query, block_mask, grad, need_max)
    return Call(backend, block_mask, scale, score, mask, mask_captured, options, wide)
