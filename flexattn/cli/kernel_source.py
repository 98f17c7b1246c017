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

__all__ = ["KINDS", "kernel_source", "explain"]

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


def explain(score_mod: Optional[Callable], mask_mod: Optional[Callable], B: int, H: int, Q_LEN: int, KV_LEN: int,
            head_dim: int, dtype, device: str, *, decode_len: int = 1) -> list[tuple[str, str]]:
    """``[(stage, what runs and why)]`` for a training call (forward and backward) and a decode call
    of ``decode_len`` query rows, of these mods and sizes on ``device``: the choices a call makes, as
    dispatch.py makes them (the FLEXATTN_DEBUG lines say the same per call). Builds the inputs and
    the BlockMask; launches nothing."""
    import math

    import torch

    from flexattn.dispatch import Call, choose_decode, pick_backend, sm90_backward_choice, sm90_forward_choice
    from flexattn.kernels.launch_order import rows_alike
    from flexattn.kernels.hopper.backward import dq_form
    from flexattn.kernels.tables import launch_tables
    from flexattn.masks import create_block_mask
    from flexattn.options import deterministic

    q = torch.randn(B, H, Q_LEN, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(B, H, KV_LEN, head_dim, dtype=dtype, device=device) for _ in range(2))
    score = trace_mod(score_mod, "score_mod")[0] if score_mod is not None else None
    block_mask = create_block_mask(mask_mod if mask_mod is not None else _everything, None, None, Q_LEN, KV_LEN,
                                   device=device)
    mask = trace_mod(block_mask.mask_mod, "mask_mod")[0] if mask_mod is not None else None
    backend = pick_backend(q, {})
    call = Call(backend, block_mask, 1.0 / math.sqrt(head_dim), score, mask, [], {}, torch.int32)
    if backend == "PYTORCH":
        why = ("AUTO runs CPU tensors on it (BACKEND='TRITON' under TRITON_INTERPRET=1 runs the portable Triton "
               "kernels in Triton's interpreter; the Gluon kernels need a Hopper GPU)"
               if q.device.type == "cpu" else "float64 has no tensor-core path")
        portable = f"blockwise PyTorch: {why}"
        return [("forward", portable), ("backward", portable), ("decode", portable)]
    lines = []
    for stage, choice in (("forward", sm90_forward_choice(call, q, k, v, need_max=False)),
                          ("backward", sm90_backward_choice(call, q, k, v))):
        _, reason = choice
        if reason is None:
            form = ""
            if stage == "backward":
                alike = rows_alike(launch_tables(block_mask), KV_LEN, block_mask.BLOCK_SIZE[1])
                fused, ordered = dq_form(q, k, deterministic(None), alike)
                form = "; dK/dV and dQ kernels"
                if fused:
                    form = f"; dQ added in the dK/dV kernel{' in a fixed order' if ordered else ''}, no dQ kernel"
            lines.append((stage, f"Gluon Hopper kernels (templates/hopper_{stage}.py.jinja){form}"))
        else:
            lines.append((stage, f"portable Triton kernels (templates/{stage}.py.jinja); not Gluon: {reason}"))
    short = q[:, :, :decode_len]
    decode_mask = block_mask if decode_len > block_mask.BLOCK_SIZE[0] else create_block_mask(
        mask_mod if mask_mod is not None else _everything, None, None, decode_len, KV_LEN, device=device)
    if choose_decode(backend, {}, short, decode_mask, needs_grad=False, need_max=False) == "TRITON_DECODE":
        lines.append(("decode", f"split-KV decode kernels (templates/decode.py.jinja) for {decode_len} query row(s)"))
    else:
        lines.append(("decode", f"the forward's kernels for {decode_len} query row(s)"))
    return lines


def _everything(b, h, q_idx, kv_idx):
    return q_idx >= 0
