"""Full, causal and prefix-LM attention: the masks every decoder starts from."""

from __future__ import annotations

from ..mods import or_masks
from ._registry import Instance, Variant


def full_mask(b, h, q_idx, kv_idx):
    """Full attention: every query sees every key (the same as passing no mask at all).

    Inputs: none. Source: "Attention Is All You Need" (Vaswani et al., 2017), encoders such as BERT.

    >>> print(picture(full_mask, 4, 6))
    ######
    ######
    ######
    ######
    """
    return q_idx >= 0


def causal_mask(b, h, q_idx, kv_idx):
    """Causal attention: a token sees itself and the tokens before it (``q_idx >= kv_idx``).

    Inputs: none; with Q_LEN < KV_LEN the indices are absolute, so queries are the *first* Q_LEN
    positions (for the last ones, as when decoding, see :func:`flexattn.offset_mask_mod`).
    Source: autoregressive decoders (GPT, "Improving Language Understanding by Generative
    Pre-Training", Radford et al., 2018).

    >>> print(picture(causal_mask, 8, 8))
    #-------
    ##------
    ###-----
    ####----
    #####---
    ######--
    #######-
    ########
    """
    return q_idx >= kv_idx


def generate_prefix_lm(prefix_length: int):
    """Prefix LM: bidirectional attention inside the first ``prefix_length`` tokens (the prompt),
    causal after them.

    Inputs: ``prefix_length`` (int, tokens of the prompt). Source: UniLM (Dong et al., 2019) and
    T5's prefix-LM objective (Raffel et al., 2020).

    >>> print(picture(generate_prefix_lm(3), 8, 8))
    ###-----
    ###-----
    ###-----
    ####----
    #####---
    ######--
    #######-
    ########
    """

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    mask = or_masks(prefix, causal_mask)
    mask.__name__ = f"prefix_lm_{prefix_length}"
    return mask


def _noop(B, H, Q, KV, device):
    return Instance(None, None)


def _causal(B, H, Q, KV, device):
    return Instance(None, causal_mask)


def _prefix(B, H, Q, KV, device):
    return Instance(None, generate_prefix_lm(max(16, min(2048, KV // 4))))


VARIANTS = [
    Variant("noop", _noop, "full attention, no mask, no score change", family="score", paper=True,
            tags=frozenset({"bidirectional"}), factories=(full_mask,)),
    Variant("causal", _causal, "each token sees itself and earlier tokens", paper=True,
            tags=frozenset({"causal"}), factories=(causal_mask,)),
    Variant("prefix_lm", _prefix, "bidirectional over a prefix of KV_LEN/4 tokens (16 to 2048), causal after it",
            paper=True, tags=frozenset({"causal", "prefix"}), factories=(generate_prefix_lm,)),
]
