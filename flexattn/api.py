"""``flex_attention``: validate the inputs, trace the mods, and hand the call to dispatch.py, directly
or through autograd (autograd.py) when a gradient is needed.

The only caller of the whole pipeline; which backend runs and how is dispatch.py's.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Optional, Union

import torch

from .autograd import FlexAttentionFunction
from .compile import described, flex_attention_op, probe, register_call
from .dispatch import Call, choose_decode, pick_backend, prepare_backward, run_forward
from .errors import InvalidInputError
from .kernels.launch import FLOAT8_DTYPES
from .lowering import check_indices, index_bounds, index_dtype
from .masks import BlockMask, as_block_mask, dense_block_mask, sliced_rows_mask_mod, torch_counterpart
from .mods import arity_mistake, noop_mask
from .options import KNOWN_OPTIONS, AuxOutput, AuxRequest, FlexKernelOptions, normalize_kernel_options, why_ignored
from .trace import TracedMod, detached, needs_grad, trace_mod

__all__ = ["flex_attention"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64) + FLOAT8_DTYPES


# ------------------------------------------------------------------------------------ validation


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _validate_tensors(query, key, value, enable_gqa: bool) -> None:
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


def _check_dtypes(query, key, value, needs_grad: bool) -> None:
    """[Note] Mixed and FP8 dtypes. As in torch, the forward takes a key and value of another dtype than
    the query's (an FP8 cache with a bfloat16 query, say): the kernels convert them to the query's
    dtype as they load them, and the output is in the query's dtype. With an FP8 query, key and
    value both products run in FP8 (P is rounded to it too) and the output is FP8, as torch's is;
    per-tensor scales fold into ``scale`` (the query's and key's) and into the output (the value's).
    A gradient needs one dtype, and one that is not FP8: there is no FP8 backward, here or in torch."""
    if not needs_grad:
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


def _validate_block_mask(block_mask: BlockMask, query, key) -> None:
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    mask_q, mask_kv = block_mask.seq_lengths
    if (mask_q, mask_kv) != (L, S):
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


def _fixed_on_device(traced: Optional[TracedMod], values: list, device: torch.device) -> list:
    """Captured values with the constants a mod builds itself (frozen on the CPU when it was traced)
    on ``device`` (TracedMod.fixed_values_on: one copy per device, kept); the user's own tensors are
    checked, not moved (_check_captured_devices)."""
    if traced is None or device.type == "cpu" or all(c.walk_index is not None for c in traced.captured):
        return values
    fixed = traced.fixed_values_on(device)
    return [v if f is None else f for f, v in zip(fixed, values)] + list(values[len(fixed):])  # then the numbers


def _check_captured_devices(traced: TracedMod, values: list, device: torch.device) -> None:
    for captured, value in zip(traced.captured, values):
        if captured.walk_index is not None and value.device != device:
            raise InvalidInputError(
                f"{traced.kind} '{traced.name}' reads the tensor '{captured.name}' on {value.device}, but the "
                f"query is on {device}; create it on the query's device (e.g. {captured.name}.to('{device}'))"
            )


_reported_ignored: set = set()  # torch's keys already named in a warning by this process


def _validate_options(kernel_options: Optional[dict]) -> dict:
    if kernel_options is None:
        return {}
    if not isinstance(kernel_options, dict):
        raise InvalidInputError(f"kernel_options must be a dict (FlexKernelOptions), got {type(kernel_options).__name__}")
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


def _as_aux_request(return_aux) -> AuxRequest:
    if isinstance(return_aux, AuxRequest):
        return return_aux
    torch_request = torch_counterpart("AuxRequest")
    if torch_request is not None and isinstance(return_aux, torch_request):
        return AuxRequest(lse=bool(return_aux.lse), max_scores=bool(return_aux.max_scores))
    raise InvalidInputError(
        f"return_aux must be a flexattn.AuxRequest (or torch's AuxRequest), got {type(return_aux).__name__}"
    )


def _traced(fn, kind: str, where: str) -> tuple[TracedMod, list]:
    try:
        return trace_mod(fn, kind)
    except Exception as err:
        mistake = arity_mistake(fn, kind, where) if callable(fn) else None
        if mistake:  # the root cause, whatever the tracer made of it
            raise InvalidInputError(mistake) from err
        raise


# Read once, at import (os.environ.get costs most of a microsecond on every call).
_CHECK_INDICES_ENV = os.environ.get("FLEXATTN_CHECK_INDICES", "0") not in ("", "0")


def _check_indices_requested(options: dict) -> bool:
    choice = options.get("CHECK_INDICES") if options else None
    return _CHECK_INDICES_ENV if choice is None else bool(choice)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod=None,
    block_mask: Optional[BlockMask] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Optional[FlexKernelOptions] = None,
    *,
    return_aux: Optional[AuxRequest] = None,
) -> Union[torch.Tensor, tuple]:
    """Attention with a user-defined score_mod and a block-sparse mask, as fused kernels in eager mode.

    Same signature and semantics as ``torch.nn.attention.flex_attention.flex_attention``.

    Args:
        query: [B, Hq, L, E]. key: [B or 1, Hkv, S, E]. value: [B or 1, Hkv, S, Ev]. float16,
            bfloat16, float32, float64, or FP8 (e4m3fn, e5m2) without gradients. Without gradients
            key and value may have another dtype than the query (an FP8 cache, say): they are
            converted to the query's (docs/fp8.md).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to ``scale * q @ k^T``
            before the softmax; ``h`` is the query head. Tensors it closes over are read in the kernel.
        block_mask: from ``create_block_mask(mask_mod, B, H, L, S)`` (flexattn's or torch's: a torch
            BlockMask is converted once and the conversion kept on it); None attends to everything.
            Build it once and reuse it for every layer that shares the mask.
        scale: defaults to ``1 / sqrt(E)``.
        enable_gqa: allow Hq to be a multiple of Hkv (query head h reads key/value head h // (Hq / Hkv)).
        return_lse: deprecated (as in torch); use ``return_aux=AuxRequest(lse=True)``.
        kernel_options: ``FlexKernelOptions``; ``{"BACKEND": "PYTORCH"}`` forces the blockwise PyTorch path,
            ``{"BACKEND": "TRITON_DECODE"}`` the split-KV decode kernels (short queries, inference),
            ``{"BACKEND": "GLUON"}`` the Hopper Gluon forward and backward, ``{"BACKEND": "TRITON"}`` the
            portable ones.
        return_aux: ``AuxRequest(lse=..., max_scores=...)`` (flexattn's or torch's) returns
            ``(out, AuxOutput)``.

    Returns:
        ``out`` [B, Hq, L, Ev] in the query's dtype; with ``return_aux``, ``(out, AuxOutput)``; with
        ``return_lse``, ``(out, lse)``. Rows with nothing kept give 0 and an LSE of -inf. ``out`` is
        stored as the query is: when the query is a transposed view of [B, L, Hq, E] storage (q cut
        from one projection), ``out.transpose(1, 2)`` is contiguous, so merging the heads back into
        [B, L, Hq * Ev] is a view; otherwise ``out`` is contiguous.

    Example::

        block_mask = create_block_mask(causal, B, None, L, L, device="cuda")   # once
        for layer in layers:
            out = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    """
    _validate_tensors(query, key, value, enable_gqa)
    if torch.compiler.is_compiling():
        return _compiled_call(query, key, value, score_mod, block_mask, scale, return_lse, kernel_options, return_aux)
    options = _validate_options(kernel_options)
    if return_lse and return_aux is not None:
        raise InvalidInputError("pass either return_lse or return_aux, not both (return_lse is deprecated)")
    if return_lse:
        warnings.warn(
            "return_lse is deprecated, as in torch; use return_aux=AuxRequest(lse=True)", FutureWarning, stacklevel=2
        )
    if return_aux is not None:
        return_aux = _as_aux_request(return_aux)
    if scale is not None and not isinstance(scale, (int, float)):
        raise InvalidInputError(f"scale must be a Python float or None, got {type(scale).__name__}")

    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if block_mask is None:
        block_mask = dense_block_mask(L, S, query.device)
        mask, mask_captured = None, []
    else:
        block_mask = as_block_mask(block_mask)  # torch's BlockMask too
        _validate_block_mask(block_mask, query, key)
        mask, mask_captured = _traced(block_mask.mask_mod, "mask_mod", "flex_attention (block_mask.mask_mod)")
        _check_captured_devices(mask, mask_captured, query.device)
        # mask_mods are boolean: their captured tensors take no gradient.
        if needs_grad(mask_captured):
            mask_captured = detached(mask_captured)
    if score_mod is not None:
        score, score_captured = _traced(score_mod, "score_mod", "flex_attention")
        _check_captured_devices(score, score_captured, query.device)
    else:
        score, score_captured = None, []
    if _check_indices_requested(options):  # a debug mode (see FlexKernelOptions.CHECK_INDICES)
        for traced, captured in ((score, score_captured), (mask, mask_captured)):
            if traced is not None:
                captured = _fixed_on_device(traced, detached(captured), query.device)
                check_indices(traced, captured, B, Hq, L, S, query.device)

    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    backend = pick_backend(query, options)
    # The PyTorch backend evaluates the mods with vmap: int64 indices where their arithmetic needs it.
    wide = index_dtype(score, mask, bounds=index_bounds(B, Hq, L, S)) if backend == "PYTORCH" else torch.int32
    score_captured = _fixed_on_device(score, score_captured, query.device)
    mask_captured = _fixed_on_device(mask, mask_captured, query.device)
    need_lse = bool(return_lse or (return_aux is not None and return_aux.lse))
    need_max = bool(return_aux is not None and return_aux.max_scores)
    wants_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad or needs_grad(score_captured)
    )
    if backend in ("TRITON", "TRITON_DECODE"):
        backend = choose_decode(backend, options, query, block_mask, wants_grad, need_max)
    call = Call(backend, block_mask, scale, score, mask, mask_captured, options, wide)
    _check_dtypes(query, key, value, wants_grad)
    if wants_grad:
        prepare_backward(call, query, key, value, score_captured)
        out, lse, mx = FlexAttentionFunction.apply(query, key, value, call, need_max, *score_captured)
    else:
        out, lse, mx = run_forward(call, query, key, value, score_captured, need_lse, need_max)

    if return_lse:
        return out, lse
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=mx if need_max else None)
    return out


# ------------------------------------------------------------------------------------ under torch.compile
# Dynamo traces what follows in place of the eager path; see [Note] flex_attention under torch.compile
# in compile.py.


def _registered_call(score_mod, mask_mod, kernel_options, device) -> str:
    """Run by Dynamo as plain Python on the real callables, once per compile of the call; its result
    (the registry key) is a constant of the graph.
    ``kernel_options``: the options' items (a tuple, see _compiled_call), or what the caller passed
    when it is not a dict (validation names it)."""
    if isinstance(kernel_options, tuple):
        kernel_options = dict(kernel_options)
    return register_call(score_mod, mask_mod, _validate_options(kernel_options), device)


# What torch.compiler.assume_constant_result does (torch 2.11 to 2.13), without the 1.7 s import of
# Dynamo it costs at import time; tests/test_compile.py checks that the decorator still sets it.
_registered_call._dynamo_marked_constant = True


def _compiled_call(query, key, value, score_mod, block_mask, scale, return_lse, kernel_options, return_aux):
    B, Hq, L, E = query.shape
    S = key.shape[2]
    if return_lse and return_aux is not None:
        raise InvalidInputError("pass either return_lse or return_aux, not both (return_lse is deprecated)")
    if block_mask is None:
        tables, mask_mod, block_size, seq_lengths = (None, None, None, None), None, [1, 1], [L, S]
    else:
        # flexattn's BlockMask or torch's: the same fields, read without converting, checked as eagerly.
        _validate_block_mask(block_mask, query, key)
        seq_lengths = [block_mask.seq_lengths[0], block_mask.seq_lengths[1]]
        tables = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                  block_mask.full_kv_indices)
        mask_mod = block_mask.mask_mod if block_mask.mask_mod is not None else noop_mask
        block_size = [block_mask.BLOCK_SIZE[0], block_mask.BLOCK_SIZE[1]]
    if mask_mod is sliced_rows_mask_mod:
        mask_mod(None, None, None, None)  # raises its explanation: rows were selected without an offset
    # The options' items are taken here, where Dynamo traces, so the graph is guarded on every key and
    # value: a dict handed whole to the constant function was guarded only on the values it was
    # seen to read, and a call with one more option (or options after none) reused the graph.
    if isinstance(kernel_options, dict):
        kernel_options = tuple(kernel_options.items())
    call_key = _registered_call(described(score_mod), described(mask_mod), kernel_options, query.device)
    # What the mods read, as Dynamo sees it: their tensors (graph values) and the numbers their torch
    # calls take (constants, or symbolic values: [Note] Numbers under torch.compile in compile.py).
    score_captured, score_numbers = probe(score_mod, "score_mod", query.device)
    mask_captured, mask_numbers = probe(mask_mod, "mask_mod", query.device)
    mask_captured = [t.detach() for t in mask_captured]
    for t in score_captured + mask_captured:
        if t.device != query.device:
            raise InvalidInputError(
                f"a mod reads a tensor on {t.device}, but the query is on {query.device}; create it on the "
                "query's device"
            )
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    need_lse = bool(return_lse or (return_aux is not None and return_aux.lse))
    need_max = bool(return_aux is not None and return_aux.max_scores)
    wants_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad or needs_grad(score_captured)
    )
    _check_dtypes(query, key, value, wants_grad)
    out, lse, mx = flex_attention_op(
        query, key, value, *tables, score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size,
        seq_lengths, scale, wants_grad, need_max,
    )
    if return_lse:
        return out, lse
    if return_aux is not None:
        return out, AuxOutput(lse=lse if need_lse else None, max_scores=mx if need_max else None)
    return out
