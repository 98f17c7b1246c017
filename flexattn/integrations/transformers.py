"""flexattn as an attention implementation of HuggingFace transformers.

    import flexattn.integrations.transformers as flexattn_hf
    flexattn_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexattn")

``register()`` adds two entries named "flexattn": the attention function to transformers'
``AttentionInterface`` and the mask builder to its ``AttentionMaskInterface`` (without the latter,
transformers passes no mask to an implementation it does not know, and a causal model would attend to
the future). The attention function honours what transformers passes to torch's flex_attention path:
a BlockMask (flexattn's or torch's), or a float mask added to the scores, the scaling, the logit
soft-cap (Gemma 2), an additive position bias, attention sinks ``s_aux`` (gpt-oss: folded in
through the LSE) and grouped-query attention; it returns the LSE as the attention weights, as
transformers' flex_attention does, when the model asks for them.

The mask builder makes torch's BlockMask (transformers checks masks against torch's class, and
Dynamo traces torch's builder inside a compiled model); the mask_mods it composes are flexattn mod
factories, so a model compiled with ``torch.compile`` gets no graph break at the attention
(docs/compile.md).

Needs ``transformers`` (``pip install flexattn[transformers]``); this module imports it on first use.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..api import flex_attention
from ..mods import mod_factory
from ..options import AuxRequest
from ..variants import apply_sinks

__all__ = ["register", "attention_forward", "block_mask_for"]

NAME = "flexattn"


def register(name: str = NAME) -> None:
    """Register flexattn with transformers under ``name`` (default "flexattn"), attention and masks."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError(
            "flexattn.integrations.transformers needs transformers with AttentionInterface and "
            "AttentionMaskInterface (4.54 or newer): pip install 'flexattn[transformers]'"
        ) from err
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, block_mask_for)


# ------------------------------------------------------------------------------------ the mods


@mod_factory
def _hf_score_mod(softcap: Optional[float], score_mask: Optional[torch.Tensor],
                  position_bias: Optional[torch.Tensor]) -> Callable:
    """transformers' score_mod: soft-cap, then an additive float mask [B, 1, Q, KV] and bias [B, H, Q, KV]."""

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if score_mask is not None:
            score = score + score_mask[b, 0, q_idx, kv_idx]
        if position_bias is not None:
            score = score + position_bias[b, h, q_idx, kv_idx]
        return score

    return score_mod


@mod_factory
def _padded(mask_function: Callable, padding_mask: torch.Tensor) -> Callable:
    """``mask_function`` where the key is not padding (``padding_mask[b, kv_idx]``, True = a token)."""

    def padded(b, h, q_idx, kv_idx):
        return mask_function(b, h, q_idx, kv_idx) & padding_mask[b, kv_idx]

    return padded


@mod_factory
def _offset(mask_function: Callable, q_offset, kv_offset) -> Callable:
    """``mask_function`` at absolute positions: queries from ``q_offset``, keys from ``kv_offset``."""

    def offset(b, h, q_idx, kv_idx):
        return mask_function(b, h, q_idx + q_offset, kv_idx + kv_offset)

    return offset


def block_mask_for(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                   mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
                   device="cpu", **kwargs):
    """transformers' mask builder for "flexattn": the BlockMask of ``mask_function`` (causal, sliding
    window, chunked, ...) with the 2-D padding ``attention_mask`` and the offsets of a cached step."""
    from transformers.masking_utils import causal_mask_function

    mask_function = causal_mask_function if mask_function is None else mask_function
    if attention_mask is not None:
        padding = attention_mask.to(device=device, dtype=torch.bool)
        if kv_length + kv_offset > padding.shape[-1]:
            padding = torch.nn.functional.pad(padding, (0, kv_length + kv_offset - padding.shape[-1]))
        mask_function = _padded(mask_function, padding)
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0):
        # As tensors the mods read, filled on the device: a step at a new position then reuses the
        # graph and the kernel, and a symbolic length of a compiled step stays in the graph.
        q_offset, kv_offset = (o if isinstance(o, torch.Tensor) else torch.full((), o, dtype=torch.int32, device=device)
                               for o in (q_offset, kv_offset))
        mask_function = _offset(mask_function, q_offset, kv_offset)
    # torch's BlockMask, which transformers' own checks recognise (it passes a prepared mask on
    # unchanged only when it is one) and whose builder Dynamo traces inside a compiled model;
    # flex_attention takes it as it takes its own.
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    return torch_create_block_mask(mask_function, batch_size, None, q_length, kv_length, device=device)


# ------------------------------------------------------------------------------------ attention


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                      softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                      position_bias: Optional[torch.Tensor] = None, **kwargs):
    """transformers' attention interface: ``query`` [B, H, Q, D], ``key``/``value`` [B, H_kv, KV, D];
    returns ``(output [B, Q, H, D], LSE [B, H, Q] or None)``."""
    if dropout > 0:
        raise ValueError(
            f"flexattn does not support attention dropout (got dropout={dropout}); use the model in eval mode "
            "(model.eval()) or set the config's attention_dropout to 0"
        )
    block_mask = score_mask = None
    if attention_mask is not None:
        if hasattr(attention_mask, "kv_num_blocks"):  # a BlockMask, flexattn's or torch's
            block_mask = attention_mask
        else:  # a float mask added to the scores (0 or -inf), [B, 1, Q, KV or more]
            score_mask = attention_mask[:, :, :, : key.shape[-2]]
            if score_mask.dtype == torch.bool:
                score_mask = torch.zeros_like(score_mask, dtype=query.dtype).masked_fill(~score_mask, float("-inf"))
    score_mod = None
    if softcap is not None or score_mask is not None or position_bias is not None:
        score_mod = _hf_score_mod(softcap, score_mask, position_bias)
    want_lse = s_aux is not None or bool(kwargs.get("output_attentions"))
    result = flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], kernel_options=kwargs.get("kernel_options"),
        return_aux=AuxRequest(lse=True) if want_lse else None,
    )
    lse = None
    if want_lse:
        out, aux = result
        lse = aux.lse
        if s_aux is not None:
            out = apply_sinks(out, lse, s_aux)
    else:
        out = result
    return out.transpose(1, 2).contiguous(), lse
