"""Masks made of fixed-size blocks of tokens: chunked attention and block diffusion."""

from __future__ import annotations

import torch

from ._registry import Instance, Variant


def generate_chunked_causal(chunk_size: int):
    """Chunked (batchified) causal attention: the sequence is cut into chunks of ``chunk_size``
    tokens and a token sees, causally, only its own chunk, as if each chunk were a separate
    sequence of the batch. Memory and compute grow linearly with the length.

    Inputs: ``chunk_size`` (int). Source: Llama 4's chunked local-attention layers (iRoPE, Meta,
    2025); block-local attention (Parmar et al., "Image Transformer", 2018).

    >>> print(picture(generate_chunked_causal(3), 8, 8))
    #-------
    ##------
    ###-----
    ---#----
    ---##---
    ---###--
    ------#-
    ------##
    """

    def chunked_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // chunk_size == kv_idx // chunk_size)

    chunked_causal.__name__ = f"chunked_causal_{chunk_size}"
    return chunked_causal


def generate_block_diffusion_mask(seq_len: int, block_size: int):
    """Block diffusion (BD3-LM) training mask over ``[x_t, x_0]``: the noised sequence x_t
    (positions ``0 .. seq_len - 1``) followed by the clean one x_0 (``seq_len .. 2 seq_len - 1``),
    both cut into blocks of ``block_size`` tokens.

    * x_t to x_t: bidirectional inside the same block (the block being denoised);
    * x_t to x_0: the clean blocks *before* its block (the context it is conditioned on);
    * x_0 to x_0: block-causal (its own block and the ones before, as the KV cache holds them);
    * x_0 to x_t: never.

    At sampling time only the block-causal x_0 part remains (blocks are decoded one at a time).
    Inputs: ``seq_len`` (int, the length of one copy), ``block_size`` (int). One sequence of
    length ``2 * seq_len``: Q_LEN == KV_LEN. Source: "Block Diffusion: Interpolating Between
    Autoregressive and Diffusion Language Models" (Arriola et al., ICLR 2025).

    >>> print(picture(generate_block_diffusion_mask(4, 2), 8, 8))
    ##------
    ##------
    --####--
    --####--
    ----##--
    ----##--
    ----####
    ----####
    """

    def block_diffusion(b, h, q_idx, kv_idx):
        q_clean, kv_clean = q_idx >= seq_len, kv_idx >= seq_len
        q_block = torch.where(q_clean, q_idx - seq_len, q_idx) // block_size
        kv_block = torch.where(kv_clean, kv_idx - seq_len, kv_idx) // block_size
        noisy_block = ~q_clean & ~kv_clean & (q_block == kv_block)
        context = ~q_clean & kv_clean & (kv_block < q_block)
        clean_causal = q_clean & kv_clean & (kv_block <= q_block)
        return noisy_block | context | clean_causal

    block_diffusion.__name__ = f"block_diffusion_{seq_len}_{block_size}"
    return block_diffusion


def _chunked(B, H, Q, KV, device):
    return Instance(None, generate_chunked_causal(max(16, min(8192, KV // 4))))


def _block_diffusion(B, H, Q, KV, device):
    # Half the sequence is x_t, half x_0 (an odd last token is one more x_0 token); 8 blocks per half.
    half = KV // 2
    return Instance(None, generate_block_diffusion_mask(half, max(4, min(1024, half // 8))))


VARIANTS = [
    Variant("chunked_causal", _chunked, "causal inside chunks of KV_LEN/4 tokens (16 to 8192; Llama 4 local layers)",
            tags=frozenset({"causal", "local", "chunked"}), factories=(generate_chunked_causal,)),
    Variant("block_diffusion", _block_diffusion,
            "BD3-LM training mask over [x_t, x_0], each half in 8 blocks (at least 4 tokens)",
            square_only=True, decode=False, tags=frozenset({"diffusion", "blockwise"}),
            factories=(generate_block_diffusion_mask,)),
]
