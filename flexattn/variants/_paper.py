"""The FlexAttention paper's benchmark variants (noop, causal, ALiBi, sliding window, prefix LM,
soft-cap, document mask). Captured tensors (ALiBi slopes, document ids) are built on the requested
device, as a user would build them.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..mods import and_masks, or_masks
from . import Instance, Variant


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_alibi_bias(num_heads: int, device="cpu"):
    """ALiBi: add ``slope[h] * (kv_idx - q_idx)``; slopes are 2^(-8(h+1)/H), captured as a tensor."""
    slopes = torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32, device=device) / num_heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def generate_sliding_window(window: int):
    """Causal attention to the last ``window`` tokens only."""

    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    mask = and_masks(causal_mask, sliding_window)
    mask.__name__ = f"sliding_window_{window}"
    return mask


def generate_prefix_lm(prefix_length: int):
    """Bidirectional attention inside the first ``prefix_length`` tokens, causal after them."""

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    mask = or_masks(prefix, causal_mask)
    mask.__name__ = f"prefix_lm_{prefix_length}"
    return mask


def generate_tanh_softcap(cap: float):
    """Soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``."""

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap.__name__ = f"softcap_{cap:g}"
    return softcap


def document_ids(lengths: list[int], device="cpu") -> torch.Tensor:
    """Document id of each token of a packed sequence: lengths [3, 2] -> [0, 0, 0, 1, 1]."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    ).to(torch.int32)


def split_lengths(total: int, num_docs: int, seed: int = 0) -> list[int]:
    """Deterministic uneven document lengths that add up to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=gen)[: num_docs - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [total]
    return [bounds[i + 1] - bounds[i] for i in range(num_docs)]


def generate_document_mask(doc_id: torch.Tensor, inner: Optional[Callable] = causal_mask):
    """Packed documents: a token sees only its own document (and, with ``inner``, causally)."""

    def same_document(b, h, q_idx, kv_idx):
        return doc_id[q_idx] == doc_id[kv_idx]

    mask = same_document if inner is None else and_masks(same_document, inner)
    mask.__name__ = "document_mask"
    return mask


def _noop(B, H, Q, KV, device):
    return Instance(None, None)


def _causal(B, H, Q, KV, device):
    return Instance(None, causal_mask)


def _alibi(B, H, Q, KV, device):
    return Instance(generate_alibi_bias(H, device), causal_mask)


def _sliding(B, H, Q, KV, device):
    return Instance(None, generate_sliding_window(max(16, min(1024, KV // 4))))


def _prefix(B, H, Q, KV, device):
    return Instance(None, generate_prefix_lm(max(16, min(2048, KV // 4))))


def _softcap(B, H, Q, KV, device):
    return Instance(generate_tanh_softcap(20.0), None)


def _document(B, H, Q, KV, device):
    assert Q == KV, "the document mask packs one sequence: Q_LEN must equal KV_LEN"
    doc = document_ids(split_lengths(KV, max(2, KV // 1024 * 2 or 2)), device)
    return Instance(None, generate_document_mask(doc))


CATALOGUE: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("noop", _noop, "full attention, no mask, no score change", family="score", paper=True),
        Variant("causal", _causal, "each token sees itself and earlier tokens", paper=True),
        Variant("alibi", _alibi, "causal, plus a per-head linear distance bias (ALiBi)", family="both", paper=True),
        Variant("sliding_window", _sliding, "causal, limited to the last 1024 tokens", paper=True),
        Variant("prefix_lm", _prefix, "bidirectional over a 2048-token prefix, causal after it", paper=True),
        Variant("softcap", _softcap, "scores squashed by cap * tanh(score / cap) (Gemma 2)", family="score", paper=True),
        Variant("document_mask", _document, "packed documents, causal inside each", square_only=True, paper=True),
    ]
}
