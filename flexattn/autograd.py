"""The autograd Function of ``flex_attention``: the forward by the chosen backend, the backward by
FlashAttention-2 recomputation from the saved LSE (both in dispatch.py).
"""

from __future__ import annotations

import torch

from .dispatch import Call, run_backward, run_forward

__all__ = ["FlexAttentionFunction"]

_DOUBLE_BACKWARD = (
    b"flex_attention does not support double backward (a gradient of its gradients, e.g. a gradient "
    b"penalty through the attention): its backward kernels are not differentiable. Compute the "
    b"attention's part of such a loss without create_graph, or use torch's math attention for it"
)


def _delay_double_backward_error(outputs: tuple) -> tuple:
    """Gradients that raise our error if anything differentiates through them (what
    torch.autograd.function.once_differentiable does, with a message that names the cause)."""
    make_error = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
    if make_error is None:  # pragma: no cover - every supported torch has it
        raise RuntimeError(_DOUBLE_BACKWARD.decode())
    tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
    if not tensors:
        return outputs
    # The error node needs inputs that require grad to give its outputs a grad_fn.
    tensors = [t.detach().requires_grad_() for t in tensors]
    wrapped = make_error(_DOUBLE_BACKWARD, len(tensors))(*tensors)
    # One input gives one tensor, not a 1-tuple: iterating it would yield its rows (issue 50, item 5).
    wrapped = iter((wrapped,) if isinstance(wrapped, torch.Tensor) else wrapped)
    return tuple(next(wrapped) if isinstance(o, torch.Tensor) else o for o in outputs)


class FlexAttentionFunction(torch.autograd.Function):
    """Inputs: q, k, v, the call (a plain ``dispatch.Call``), need_max, then the score_mod's captured
    tensors (so autograd routes their gradients). Outputs: out, lse, max_scores."""

    @staticmethod
    def forward(ctx, q, k, v, call, need_max, *score_captured):
        out, lse, mx = run_forward(call, q, k, v, list(score_captured), True, need_max)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse, *score_captured)
        if mx is not None:
            ctx.mark_non_differentiable(mx)
        return out, lse, mx

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_max):
        with torch.no_grad():
            grads = _backward(ctx, grad_out, grad_lse)
        if torch.is_grad_enabled():  # create_graph=True: refuse differentiating these
            grads = _delay_double_backward_error(grads)
        return grads


def _backward(ctx, grad_out, grad_lse):
    call: Call = ctx.call
    q, k, v, out, lse, *score_captured = ctx.saved_tensors
    dq, dk, dv, d_captured = run_backward(call, q, k, v, out, lse, grad_out, grad_lse, score_captured)
    needs = ctx.needs_input_grad
    dq, dk, dv = (g if needs[i] else None for i, g in enumerate((dq, dk, dv)))
    d_captured = [g if needs[5 + i] else None for i, g in enumerate(d_captured)]
    return (dq, dk, dv, None, None, *d_captured)
