"""Several sequences in one: packed documents (from lengths or from offsets) and continuations
that share one prompt."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..mods import and_masks
from ._registry import Instance, Variant
from .causal import causal_mask, generate_prefix_lm


def document_ids(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    """Document id of each token of a packed sequence, from the documents' lengths:
    ``[3, 2] -> [0, 0, 0, 1, 1]`` (int32)."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    ).to(torch.int32)


def document_ids_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Document id of each token, from the documents' start offsets ``[0, s1, ..., total]`` (the
    cumulative lengths, as varlen kernels take them): ``[0, 3, 5] -> [0, 0, 0, 1, 1]`` (int32)."""
    offsets = torch.as_tensor(offsets)
    return document_ids(torch.diff(offsets).tolist(), device=offsets.device)


def split_lengths(total: int, num_docs: int, seed: int = 0) -> list[int]:
    """Deterministic uneven document lengths that add up to ``total`` (at most ``total`` documents,
    none when ``total`` is 0)."""
    if total <= 0:
        return []
    num_docs = max(1, min(num_docs, total))
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=gen)[: num_docs - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [total]
    return [bounds[i + 1] - bounds[i] for i in range(num_docs)]


def generate_document_mask(doc_id: torch.Tensor, inner: Optional[Callable] = causal_mask):
    """Packed documents (sequence packing): a token sees only tokens of its own document, and inside
    it whatever ``inner`` allows (causal by default, None for bidirectional).

    Inputs: ``doc_id`` (int tensor ``[L]``, captured: the document of each token, from
    :func:`document_ids` (lengths) or :func:`document_ids_from_offsets`), ``inner`` (a mask_mod
    in the packed sequence's positions, or None). One sequence: Q_LEN == KV_LEN == L.
    Source: sequence packing for training (e.g. "Efficient Sequence Packing without
    Cross-contamination", Kosec et al., 2021); the FlexAttention paper's document mask.

    >>> print(picture(generate_document_mask(document_ids([3, 2, 3])), 8, 8))
    #-------
    ##------
    ###-----
    ---#----
    ---##---
    -----#--
    -----##-
    -----###
    """

    def same_document(b, h, q_idx, kv_idx):
        return doc_id[q_idx] == doc_id[kv_idx]

    mask = same_document if inner is None else and_masks(same_document, inner)
    mask.__name__ = "document_mask"
    return mask


def generate_packed_document_mask(offsets: torch.Tensor, inner: Callable):
    """Packed documents from offsets, with ``inner`` applied in each document's *own* positions:
    ``inner(b, h, q_idx - start, kv_idx - start)``, so a position-dependent mask (a prefix LM, a
    sliding window anchored at the start) restarts in every document.

    Inputs: ``offsets`` (int tensor ``[D + 1]``: 0, the start of each later document, then the
    total length L, as varlen kernels take them), ``inner`` (a mask_mod written for one document).
    One sequence: Q_LEN == KV_LEN == L. Source: attention-gym's ``generate_doc_mask_mod``; packed
    instruction tuning, where every sample is a prompt (bidirectional) then an answer (causal).

    >>> offsets = torch.tensor([0, 3, 8])
    >>> print(picture(generate_packed_document_mask(offsets, generate_prefix_lm(2)), 8, 8))
    ##------
    ##------
    ###-----
    ---##---
    ---##---
    ---###--
    ---####-
    ---#####
    """
    offsets = torch.as_tensor(offsets)
    doc_id = document_ids_from_offsets(offsets)
    starts = offsets.to(device=doc_id.device, dtype=torch.int32)

    def packed_document(b, h, q_idx, kv_idx):
        q_doc, kv_doc = doc_id[q_idx], doc_id[kv_idx]
        start = starts[q_doc]
        return (q_doc == kv_doc) & inner(b, h, q_idx - start, kv_idx - start)

    packed_document.__name__ = f"packed_{getattr(inner, '__name__', 'mask')}"
    return packed_document


def branch_ids(prefix_length: int, lengths: Sequence[int], device="cpu") -> torch.Tensor:
    """Branch of each token for :func:`generate_shared_prefix_mask`: 0 for the prompt's
    ``prefix_length`` tokens, then 1, 2, ... for the continuations of ``lengths`` (int32)."""
    return document_ids([prefix_length, *lengths], device=device)


def generate_shared_prefix_mask(branch: torch.Tensor):
    """Shared prefix: one prompt followed by several continuations packed after it; each
    continuation sees the whole prompt and itself (causally), never the other continuations. One
    forward pass then scores all continuations while reading the prompt once.

    Inputs: ``branch`` (int tensor ``[L]``, captured: 0 for prompt tokens, ``i`` for the i-th
    continuation; :func:`branch_ids` builds it). One sequence: Q_LEN == KV_LEN == L.
    Source: shared-prompt sampling and training, e.g. Hydragen (Juravsky et al., 2024), several
    samples per prompt in GRPO (Shao et al., 2024), tree attention for speculative decoding.

    >>> print(picture(generate_shared_prefix_mask(branch_ids(3, [2, 3])), 8, 8))
    #-------
    ##------
    ###-----
    ####----
    #####---
    ###--#--
    ###--##-
    ###--###
    """

    def shared_prefix(b, h, q_idx, kv_idx):
        kv_branch = branch[kv_idx]
        return (q_idx >= kv_idx) & ((kv_branch == 0) | (branch[q_idx] == kv_branch))

    return shared_prefix


def _document(B, H, Q, KV, device):
    assert Q == KV, "the document mask packs one sequence: Q_LEN must equal KV_LEN"
    doc = document_ids(split_lengths(KV, max(2, KV // 1024 * 2 or 2)), device)
    return Instance(None, generate_document_mask(doc))


def _packed(B, H, Q, KV, device):
    # About one document per 256 tokens (at least 3); each a prompt of 8 to 128 tokens, then causal.
    num_docs = max(3, KV // 256)
    lengths = split_lengths(KV, num_docs, seed=1)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    prompt = max(8, min(128, KV // (4 * num_docs)))
    return Instance(None, generate_packed_document_mask(offsets, generate_prefix_lm(prompt)))


def _shared_prefix(B, H, Q, KV, device):
    # A prompt of a quarter of the sequence, then 3 continuations of uneven lengths.
    prompt = max(1, KV // 4)
    continuations = split_lengths(KV - prompt, 3, seed=2)
    return Instance(None, generate_shared_prefix_mask(branch_ids(prompt, continuations, device)))


VARIANTS = [
    Variant("document_mask", _document, "packed documents (from lengths), causal inside each", square_only=True,
            paper=True, tags=frozenset({"causal", "packed"}), factories=(generate_document_mask, document_ids)),
    Variant("packed_documents", _packed,
            "packed documents (from offsets), each a prefix LM in its own positions", square_only=True,
            tags=frozenset({"causal", "packed", "prefix"}),
            factories=(generate_packed_document_mask, document_ids_from_offsets)),
    Variant("shared_prefix", _shared_prefix,
            "a prompt of KV_LEN/4 tokens shared by 3 continuations packed after it", square_only=True,
            tags=frozenset({"causal", "packed", "prefix"}), factories=(generate_shared_prefix_mask, branch_ids)),
]
