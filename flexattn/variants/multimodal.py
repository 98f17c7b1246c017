"""Cross-attention from text tokens to image tokens."""

from __future__ import annotations

from typing import Sequence

import torch

from ._registry import Instance, Variant


def interleaved_layout(text_len: int, image_positions: Sequence[int], tokens_per_image: int, device="cpu"):
    """The two tables :func:`generate_text_to_image_mask` reads, for images interleaved with text.

    ``image_positions[i]`` is the text position the i-th image comes right before (non-decreasing).
    Returns ``(last_image, image_of_key)``: ``last_image[t]`` is the index of the last image before
    text token ``t`` (-1 when none), ``image_of_key[j] = j // tokens_per_image`` is the image of
    visual token ``j`` (the images' tokens are concatenated as the keys). Both int32.
    """
    positions = torch.tensor(list(image_positions), dtype=torch.int64)
    text = torch.arange(text_len)
    last_image = (positions.view(1, -1) <= text.view(-1, 1)).sum(dim=1) - 1
    image_of_key = torch.arange(len(positions) * tokens_per_image) // tokens_per_image
    return last_image.to(device=device, dtype=torch.int32), image_of_key.to(device=device, dtype=torch.int32)


def generate_text_to_image_mask(last_image: torch.Tensor, image_of_key: torch.Tensor, only_last: bool = True):
    """Text-to-image cross-attention (Flamingo): queries are text tokens, keys are the visual tokens
    of the images interleaved with the text; a text token sees only the image just before it
    (``only_last=True``, as Flamingo), or every image before it (``only_last=False``). Text before
    the first image sees nothing (its row is fully masked: output 0, and Flamingo's tanh gate
    passes the text through).

    Inputs: ``last_image`` (int tensor ``[Q_LEN]``: index of the last image before each text token,
    -1 for none), ``image_of_key`` (int tensor ``[KV_LEN]``: the image each visual token belongs
    to); :func:`interleaved_layout` builds both. Q_LEN (text) and KV_LEN (image tokens) differ.
    Source: Flamingo (Alayrac et al., 2022), its masked cross-attention; also Llama 3.2 Vision.

    >>> last_image, image_of_key = interleaved_layout(8, [2, 5], 3)
    >>> print(picture(generate_text_to_image_mask(last_image, image_of_key), 8, 6))
    ------
    ------
    ###---
    ###---
    ###---
    ---###
    ---###
    ---###
    """

    def text_to_image(b, h, q_idx, kv_idx):
        image = image_of_key[kv_idx]
        last = last_image[q_idx]
        seen = image == last if only_last else image <= last
        return seen & (last >= 0)

    text_to_image.__name__ = "text_to_last_image" if only_last else "text_to_earlier_images"
    return text_to_image


def _flamingo(B, H, Q, KV, device):
    # 4 images of KV_LEN/4 tokens (the last one takes the remainder; fewer images when KV_LEN < 4);
    # the first comes after Q/8 text tokens, the others every Q/4, so the first rows see no image.
    images = max(1, min(4, KV))
    per_image = max(1, KV // images)
    last_image, image_of_key = interleaved_layout(Q, [Q // 8 + i * (Q // 4) for i in range(images)], per_image, device)
    image_of_key = torch.cat([image_of_key, image_of_key.new_full((KV - image_of_key.numel(),), images - 1)])[:KV]
    return Instance(None, generate_text_to_image_mask(last_image, image_of_key))


VARIANTS = [
    Variant("text_to_image", _flamingo,
            "Flamingo cross-attention: Q_LEN text tokens, each sees only the last of 4 images before it",
            tags=frozenset({"cross-attention", "multimodal"}),
            factories=(generate_text_to_image_mask, interleaved_layout)),
]
