"""``flex_attention``: the eager call and its path under torch.compile. Both take the front door of
request.py (the checks, the options, the request, the Call), trace the mods, and hand the call to
dispatch.py, directly or through autograd (autograd.py) when a gradient is needed.

The only caller of the whole pipeline; which backend runs and how is dispatch.py's.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from .autograd import FlexAttentionFunction
from .compile import described, flex_attention_op, probe, register_call
from .dispatch import prepare_backward, run_forward
from .errors import InvalidInputError
from .lowering import check_indices
from .masks import BlockMask, as_block_mask, dense_block_mask, sliced_rows_mask_mod
from .mods import arity_mistake, noop_mask
from .options import AuxRequest, FlexKernelOptions
from .request import (
    build_call, captured_on, check_block_mask, check_grad_dtypes, check_tensors, options_of, request_of, wants_grad,
)
from .trace import detached, needs_grad, trace_mod

__all__ = ["flex_attention"]


def _explain_trace_error(err: Exception, fn, kind: str, where: str) -> None:
    """Raise the root cause of ``trace_mod(fn, kind)`` raising ``err`` when it is a mod of the wrong
    arity, whatever the tracer made of it; return (the caller re-raises ``err``) otherwise."""
    mistake = arity_mistake(fn, kind, where) if callable(fn) else None
    if mistake:
        raise InvalidInputError(mistake) from err


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
    check_tensors(query, key, value, enable_gqa)
    if torch.compiler.is_compiling():
        return _compiled_call(query, key, value, score_mod, block_mask, scale, return_lse, kernel_options, return_aux)
    options = options_of(kernel_options)
    scale, outputs = request_of(query, scale, return_lse, return_aux)

    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if block_mask is None:
        block_mask = dense_block_mask(L, S, query.device)
        mask, mask_captured = None, []
    else:
        if not isinstance(block_mask, BlockMask):
            block_mask = as_block_mask(block_mask)  # torch's BlockMask
        check_block_mask(block_mask, query, key)
        try:  # trace_mod inline, not through a helper: a warm call's every Python call counts (docs/host_path.md)
            mask, mask_captured = trace_mod(block_mask.mask_mod, "mask_mod")
        except Exception as err:
            _explain_trace_error(err, block_mask.mask_mod, "mask_mod", "flex_attention (block_mask.mask_mod)")
            raise
        mask_captured = captured_on(mask, mask_captured, query.device)
        # mask_mods are boolean: their captured tensors take no gradient.
        if mask_captured and needs_grad(mask_captured):
            mask_captured = detached(mask_captured)
    if score_mod is not None:
        try:
            score, score_captured = trace_mod(score_mod, "score_mod")
        except Exception as err:
            _explain_trace_error(err, score_mod, "score_mod", "flex_attention")
            raise
        score_captured = captured_on(score, score_captured, query.device)
    else:
        score, score_captured = None, []
    # A debug mode (FlexKernelOptions.CHECK_INDICES); no call asked without options or the variable.
    if (_CHECK_INDICES_ENV or options) and _check_indices_requested(options):
        for traced, captured in ((score, score_captured), (mask, mask_captured)):
            if traced is not None:
                check_indices(traced, detached(captured), B, Hq, L, S, query.device)

    grad = wants_grad(query, key, value, score_captured)
    call = build_call(query, S, block_mask, score, mask, mask_captured, options, scale, grad, outputs.need_max)
    if grad:
        check_grad_dtypes(query, key, value, grad)
        prepare_backward(call, query, key, value, score_captured)
        out, lse, mx = FlexAttentionFunction.apply(query, key, value, call, outputs.need_max, *score_captured)
    else:
        out, lse, mx = run_forward(call, query, key, value, score_captured, outputs.need_lse, outputs.need_max)
    if not outputs.return_lse and outputs.aux is None:  # Outputs.returned's answer, without the call
        return out
    return outputs.returned(out, lse, mx)


# ------------------------------------------------------------------------------------ under torch.compile
# Dynamo traces what follows in place of the eager path; see [Note] flex_attention under torch.compile
# in compile/__init__.py.


def _registered_call(score_mod, mask_mod, kernel_options, device) -> str:
    """Run by Dynamo as plain Python on the real callables, once per compile of the call; its result
    (the registry key) is a constant of the graph. The options are checked here (options_of: Dynamo
    cannot trace its warning), and the tensors the mods read, as eagerly (register_call).
    ``kernel_options``: the options' items (a tuple, see _compiled_call), or what the caller passed
    when it is not a dict (validation names it)."""
    if isinstance(kernel_options, tuple):
        kernel_options = dict(kernel_options)
    return register_call(score_mod, mask_mod, options_of(kernel_options), device)


# What torch.compiler.assume_constant_result does (torch 2.11 to 2.13), without the 1.7 s import of
# Dynamo it costs at import time; tests/test_compile.py checks that the decorator still sets it.
_registered_call._dynamo_marked_constant = True


def _compiled_call(query, key, value, score_mod, block_mask, scale, return_lse, kernel_options, return_aux):
    """The call as Dynamo traces it: the same checks as the eager call's (request.py), then one
    custom op (compile/ops.py), whose bodies build the Call."""
    scale, outputs = request_of(query, scale, return_lse, return_aux)
    L, S = query.shape[2], key.shape[2]
    if block_mask is None:
        tables, mask_mod, block_size, seq_lengths = (None, None, None, None), None, [1, 1], [L, S]
    else:
        # flexattn's BlockMask or torch's: the same fields, read without converting, checked as eagerly.
        check_block_mask(block_mask, query, key)
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
    # calls take (constants, or symbolic values: [Note] Numbers under torch.compile in compile/registry.py).
    score_captured, score_numbers = probe(score_mod, "score_mod", query.device)
    mask_captured, mask_numbers = probe(mask_mod, "mask_mod", query.device)
    mask_captured = [t.detach() for t in mask_captured]
    grad = wants_grad(query, key, value, score_captured)
    check_grad_dtypes(query, key, value, grad)
    out, lse, mx = flex_attention_op(
        query, key, value, *tables, score_captured, mask_captured, score_numbers, mask_numbers, call_key, block_size,
        seq_lengths, scale, grad, outputs.need_max,
    )
    return outputs.returned(out, lse, mx)
