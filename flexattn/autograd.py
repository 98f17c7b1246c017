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


def _delay_double_backward_error(grads: tuple, inputs: tuple) -> tuple:
    """``grads`` made to raise our error if anything differentiates through them (what
    torch.autograd.function.once_differentiable does, with a message that names the cause).

    ``inputs``: the Function's tensor inputs. The error node takes those that require grad as its
    own inputs, so a second ``torch.autograd.grad(dq, q)`` reaches it and raises; tied to detached
    copies instead (as once_differentiable is), that call would only say that q was unused."""
    make_error = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
    if make_error is None:  # pragma: no cover - every supported torch has it
        raise RuntimeError(_DOUBLE_BACKWARD.decode())
    tensors = [g for g in grads if isinstance(g, torch.Tensor)]
    if not tensors:
        return grads
    anchors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not anchors:  # the node needs an input that requires grad to give its outputs a grad_fn
        anchors = [tensors[0].detach().requires_grad_()]
    wrapped = make_error(_DOUBLE_BACKWARD, len(tensors) + len(anchors))(*tensors, *anchors)
    # Its outputs alias its inputs, in order (a tuple: it has two inputs at least, and for one it would
    # give a bare tensor): the first ones are the gradients.
    wrapped = iter(wrapped[: len(tensors)])
    return tuple(next(wrapped) if isinstance(g, torch.Tensor) else g for g in grads)


class FlexAttentionFunction(torch.autograd.Function):
    """Inputs: q, k, v, the call (a plain ``dispatch.Call``), need_max, then the score_mod's captured
    values (so autograd routes their tensors' gradients; then the numbers it reads). Outputs: out,
    lse, max_scores."""

    @staticmethod
    def forward(ctx, q, k, v, call, need_max, *score_captured):
        out, lse, mx = run_forward(call, q, k, v, list(score_captured), True, need_max)
        ctx.call = call
        tensors = [t for t in score_captured if isinstance(t, torch.Tensor)]
        ctx.numbers = score_captured[len(tensors):]  # the tensors come first (trace.TracedMod.captured_values)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        if mx is not None:
            ctx.mark_non_differentiable(mx)
        return out, lse, mx

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_max):
        q, k, v, out, lse, *score_captured = ctx.saved_tensors
        score_captured += ctx.numbers
        with torch.no_grad():
            grads = _backward(ctx, q, k, v, out, lse, score_captured, grad_out, grad_lse)
        if torch.is_grad_enabled():  # create_graph=True: refuse differentiating these
            grads = _delay_double_backward_error(grads, (q, k, v, *score_captured))
        return grads


def _backward(ctx, q, k, v, out, lse, score_captured, grad_out, grad_lse):
    call: Call = ctx.call
    dq, dk, dv, d_captured = run_backward(call, q, k, v, out, lse, grad_out, grad_lse, score_captured)
    needs = ctx.needs_input_grad
    dq, dk, dv = (g if needs[i] else None for i, g in enumerate((dq, dk, dv)))
    d_captured = [g if needs[5 + i] else None for i, g in enumerate(d_captured)]
    return (dq, dk, dv, None, None, *d_captured)
