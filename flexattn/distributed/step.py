"""One step of a rank, run the way ``flex_attention`` runs a call, and the exact merge of steps.

A step's forward and backward go straight to dispatch.py with a ``Call`` built as every entry
builds one (request.py: the mods' captured values on the device, then build_call). The backward
then runs each step's backward kernels once, with the *merged* output and LSE of the whole row
([Note] Backward from the merged statistics), instead of recomputing each step's forward to
differentiate its partial result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dispatch import Call, forward_into, prepare_backward, run_backward, run_forward
from ..reference import working_dtype
from ..request import build_call, captured_on
from ..trace import detached, trace_mod
from .plan import Step

__all__ = ["StepCall", "step_call", "chunk_step_calls", "merge_into", "working_dtype"]


class StepCall(NamedTuple):
    """A step with the Call that runs it and the score_mod's captured tensors for this call."""

    step: Step
    call: Call
    score_captured: list

    def forward(self, q, k, v, need_max: bool):
        """``(out, lse, max_scores or None)`` of the rank's queries against this step's keys."""
        return run_forward(self.call, q, k, v, self.score_captured, True, need_max)

    def forward_into(self, q, k, v, running: tuple) -> bool:
        """Merge this step's forward into ``running`` = ``(out, lse, max_scores or None)`` in its
        kernel, as ``merge_into`` would ([Note] Merging into the running result in
        templates/forward.py.jinja); False, having run nothing, where its kernel cannot
        (dispatch.forward_into says which)."""
        return forward_into(self.call, q, k, v, self.score_captured, running)

    def backward(self, q, k, v, out, lse, grad_out, grad_lse):
        """``(dq, dk, dv, [gradient of each captured tensor or None])`` of this step's share.

        [Note] Backward from the merged statistics
        The row's softmax over all steps is ``P = exp(S - lse)`` with the merged ``lse``, and
        ``dS = P * (dP - rowsum(dO * O) + dlse)`` with the merged output ``O``: both are the row's,
        not the step's. So each step's backward kernels, given the merged ``out`` and ``lse`` (what
        a single-GPU backward is given), produce exactly that step's part of dQ, and the whole of
        dK, dV for its keys from these queries. No step's partial output is kept or recomputed.
        dK and dV come back in float32: a key's gradient is the sum of every rank's part, and
        rounding each part to bf16 before the sum would double its error.
        """
        return run_backward(self.call, q, k, v, out, lse, grad_out, grad_lse, self.score_captured,
                            float32_kv_grads=True)


def step_call(step: Step, score_mod, position_dtype: torch.dtype, q: torch.Tensor, options: dict, scale: float,
              needs_grad: bool, need_max: bool) -> StepCall:
    """The StepCall of ``step`` for a call of ``score_mod`` (None: none) on the query shard ``q``."""
    B, S = q.shape[0], step.kv_positions.numel()
    if score_mod is None:
        score, score_captured = None, []
    else:
        score, score_captured = trace_mod(step.score_mod_at(score_mod, position_dtype), "score_mod")
    mask, mask_captured = trace_mod(step.block_mask.mask_mod, "mask_mod")
    mask_captured = captured_on(mask, detached(mask_captured), q.device)
    call = build_call(q, S, step.block_mask, score, mask, mask_captured, options, scale, needs_grad, need_max)
    step_call_ = StepCall(step, call, captured_on(score, score_captured, q.device))
    if needs_grad:
        # The gradient is lowered now, at the forward, as flex_attention does; only k's length is read.
        prepare_backward(call, q, q.new_empty(()).expand(B, 1, S, q.shape[-1]))
    return step_call_


def chunk_step_calls(steps: list, chunks: int, score_mod, position_dtype: torch.dtype, q: torch.Tensor,
                     kv_heads: int, options: dict, scale: float, needs_grad: bool, need_max: bool) -> list:
    """``[(query heads, key/value heads, [StepCall per step])]`` of each of ``chunks`` chunks of the
    heads ([Note] Head chunks in ring.py); ``chunks`` divides ``kv_heads``."""
    q_heads = q.shape[1]
    found = []
    for c in range(chunks):
        qs = slice(c * q_heads // chunks, (c + 1) * q_heads // chunks)
        ks = slice(c * kv_heads // chunks, (c + 1) * kv_heads // chunks)
        chunk_steps = steps if chunks == 1 else [step.on_heads(qs.start, qs.stop - qs.start) for step in steps]
        found.append((qs, ks, [step_call(step, score_mod, position_dtype, q[:, qs], options, scale, needs_grad,
                                         need_max) for step in chunk_steps]))
    return found


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the partial result ``(out, lse)`` of more keys into the running one, in place.

    Exact: the softmax over the union of the keys is ``sum_i exp(lse_i - lse) out_i`` with
    ``lse = logaddexp(lse_i...)``, computed in the accumulator's precision (float32, or float64).
    Rows that neither side keeps a key of have ``lse = -inf``: subtracting 0 there instead gives
    weights ``exp(-inf) = 0``, so they stay 0 and their LSE -inf, with no NaN.
    """
    merged = torch.logaddexp(acc_lse, lse)
    finite = torch.where(torch.isneginf(merged), torch.zeros_like(merged), merged)
    acc_out.mul_(torch.exp(acc_lse - finite).unsqueeze(-1))
    acc_out.addcmul_(out, torch.exp(lse - finite).unsqueeze(-1))  # out converted as read: no copy of it
    acc_lse.copy_(merged)
