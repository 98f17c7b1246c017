"""Local windows over a 1-D sequence: sliding window, dilated sliding window, and Longformer's
sliding window with global tokens."""

from __future__ import annotations

import torch

from ..mods import and_masks
from ._registry import Instance, Variant
from .causal import causal_mask


def generate_sliding_window(window: int):
    """Sliding-window causal attention: a token sees itself and the ``window`` tokens before it.

    Inputs: ``window`` (int, how far back a query looks; ``q_idx - kv_idx <= window``).
    Source: local attention in the Sparse Transformer (Child et al., 2019) and Longformer
    (Beltagy et al., 2020); Mistral 7B (Jiang et al., 2023) and Gemma 2 use it in decoders.

    >>> print(picture(generate_sliding_window(2), 8, 8))
    #-------
    ##------
    ###-----
    -###----
    --###---
    ---###--
    ----###-
    -----###
    """

    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    mask = and_masks(causal_mask, sliding_window)
    mask.__name__ = f"sliding_window_{window}"
    return mask


def generate_dilated_sliding_window(window: int, dilation: int):
    """Dilated sliding window: the ``window`` most recent tokens at a stride of ``dilation``, the
    query itself included (``q_idx - kv_idx`` in ``0, dilation, ..., (window - 1) * dilation``).

    Inputs: ``window`` (int, keys per query), ``dilation`` (int, the stride; 1 is a plain sliding
    window of ``window - 1`` tokens back). Different heads often use different dilations.
    Source: Longformer's dilated sliding window (Beltagy et al., 2020).

    >>> print(picture(generate_dilated_sliding_window(3, 2), 8, 8))
    #-------
    -#------
    #-#-----
    -#-#----
    #-#-#---
    -#-#-#--
    --#-#-#-
    ---#-#-#
    """
    if window < 1 or dilation < 1:
        raise ValueError(f"generate_dilated_sliding_window: window ({window}) and dilation ({dilation}) must be >= 1")
    span = window * dilation

    def dilated_sliding_window(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < span) & (distance % dilation == 0)

    dilated_sliding_window.__name__ = f"dilated_sliding_window_{window}x{dilation}"
    return dilated_sliding_window


def generate_longformer_mask(window: int, is_global: torch.Tensor):
    """Longformer: a bidirectional sliding window, plus *global* tokens that see every token and
    that every token sees (e.g. the [CLS] token, or the question in question answering).

    Inputs: ``window`` (int, keys each side: ``|q_idx - kv_idx| <= window``), ``is_global`` (bool
    tensor ``[L]``, captured: which positions are global). One sequence: Q_LEN == KV_LEN == L.
    Source: Longformer (Beltagy et al., 2020); BigBird (Zaheer et al., 2020) adds random keys.

    >>> is_global = torch.zeros(8, dtype=torch.bool); is_global[[0, 5]] = True
    >>> print(picture(generate_longformer_mask(1, is_global), 8, 8))
    ########
    ###--#--
    ####-#--
    #-####--
    #--###--
    ########
    #----###
    #----###
    """

    def longformer(b, h, q_idx, kv_idx):
        near = (q_idx - kv_idx).abs() <= window
        return near | is_global[q_idx] | is_global[kv_idx]

    longformer.__name__ = f"longformer_{window}"
    return longformer


def _sliding(B, H, Q, KV, device):
    return Instance(None, generate_sliding_window(max(16, min(1024, KV // 4))))


def _dilated(B, H, Q, KV, device):
    return Instance(None, generate_dilated_sliding_window(max(8, min(512, KV // 8)), 2))


def _longformer(B, H, Q, KV, device):
    # Global tokens: the first KV/64 positions (at least one, like [CLS]) and one in the middle.
    is_global = torch.zeros(KV, dtype=torch.bool, device=device)
    is_global[: max(1, KV // 64)] = True
    is_global[KV // 2] = True
    return Instance(None, generate_longformer_mask(max(4, min(256, KV // 8)), is_global))


VARIANTS = [
    Variant("sliding_window", _sliding, "causal, limited to the last KV_LEN/4 tokens (16 to 1024)", paper=True,
            tags=frozenset({"causal", "local"}), factories=(generate_sliding_window,)),
    Variant("dilated_sliding_window", _dilated,
            "causal, the last KV_LEN/8 tokens (8 to 512) at a stride of 2 (Longformer's dilated window)",
            tags=frozenset({"causal", "local", "dilated"}), factories=(generate_dilated_sliding_window,)),
    Variant("longformer", _longformer,
            "bidirectional window of KV_LEN/8 tokens (4 to 256) each side, plus global tokens (Longformer)",
            square_only=True, decode=False, tags=frozenset({"bidirectional", "local", "global"}),
            factories=(generate_longformer_mask,)),
]
