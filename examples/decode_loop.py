"""A decoding loop: one new token per sequence per step, against a KV cache.

Three sequences with prompts of different lengths decode a few tokens each, with a sliding-window
causal mask and a soft-capped ALiBi bias (both depend on the query's absolute position, so a wrong
offset shows). The mods are written for full sequences; ``offset_score_mod`` puts each step's query at its absolute position and
``decode_block_mask`` cuts the step's BlockMask from the full-length one, masking the cache slots
past each sequence's valid length. The positions are a tensor updated in place, so every step
reuses the same traced mods and the same kernel (``flexattn.trace.counts.traces`` does not move).
With ``--paged`` the sequences share one paged cache (``flexattn.PagedAttention``).

The "model" is a stand-in: the queries, keys and values of every position are drawn up front, so
each step's output can be checked against attention over the whole sequence at once.

    python examples/decode_loop.py            # contiguous cache, CPU: a few seconds
    python examples/decode_loop.py --paged    # one paged cache for all sequences

Exits with status 1 if a step differs from the full-sequence attention or a step retraced a mod.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flexattn
from flexattn import (
    PagedAttention, and_masks, create_block_mask, decode_block_mask, flex_attention, offset_score_mod,
)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_sliding_window(window: int):
    def within_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    return and_masks(causal, within_window)


def make_capped_alibi(num_heads: int, cap: float, device):
    # ALiBi alone would not show a wrong query offset: it shifts every score of a row by the same
    # amount, which the softmax ignores. Capping the biased score with tanh (as Gemma 2 caps its
    # logits) makes the result depend on the absolute distance.
    slopes = torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32, device=device) / num_heads)

    def capped_alibi(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh((score + slopes[h] * (kv_idx - q_idx)) / cap)

    return capped_alibi


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--paged", action="store_true", help="serve the sequences from one paged cache")
    parser.add_argument("--prompts", type=int, nargs="+", default=[5, 17, 40], help="prompt length of each sequence")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=128, help="cache length per sequence")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.prompts) < 1 or max(args.prompts) + args.new_tokens > args.max_len:
        parser.error(f"prompts must be >= 1 and prompt + --new-tokens must fit in --max-len ({args.max_len})")

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    B, Hq, Hkv, D, MAX = len(args.prompts), 4, 2, 16, args.max_len  # 4 query heads on 2 key/value heads (GQA)
    block = 32
    q_all = torch.randn(B, Hq, MAX, D, device=device)
    k_all, v_all = (torch.randn(B, Hkv, MAX, D, device=device) for _ in range(2))
    score_mod = make_capped_alibi(Hq, cap=5.0, device=device)
    mask_mod = make_sliding_window(24)

    # The reference: every position at once, with the mods as written.
    full_mask = create_block_mask(mask_mod, None, None, MAX, MAX, device=device, BLOCK_SIZE=block)  # built once
    expected = flex_attention(q_all, k_all, v_all, score_mod=score_mod, block_mask=full_mask, enable_gqa=True)

    pos = torch.tensor(args.prompts, device=device)  # the position of each sequence's next token
    kv_len = pos + 1  # the valid cache length at a step: the prompt and the tokens so far, this one included
    batch = torch.arange(B, device=device)
    step_score = offset_score_mod(score_mod, pos)  # reads pos: built once, right at every step

    if args.paged:
        page_size = 16
        n_pages = B * MAX // page_size
        paged = PagedAttention(n_pages, page_size, max_batch_size=B, device=device)
        k_cache = torch.randn(1, Hkv, n_pages * page_size, D, device=device) * 5  # stale slots must not count
        v_cache = torch.randn(1, Hkv, n_pages * page_size, D, device=device) * 5
        for b, length in enumerate(args.prompts):  # prefill: reserve pages, write the prompt
            paged.reserve(b, length)
            where = torch.arange(length, device=device)[None]
            paged.assign(batch[b:b + 1], where, k_all[b:b + 1, :, :length], v_all[b:b + 1, :, :length], k_cache, v_cache)
        step_score = paged.get_score_mod(step_score, batch_idx=batch)  # reads the live page table
    else:
        k_cache = torch.randn(B, Hkv, MAX, D, device=device) * 5
        v_cache = torch.randn(B, Hkv, MAX, D, device=device) * 5
        for b, length in enumerate(args.prompts):
            k_cache[b, :, :length] = k_all[b, :, :length]
            v_cache[b, :, :length] = v_all[b, :, :length]

    print(f"device {device}, {'paged' if args.paged else 'contiguous'} cache, prompts {args.prompts}, "
          f"{args.new_tokens} new tokens each, {Hq} query heads on {Hkv} key/value heads")
    traces_after_first_step = None
    worst = 0.0
    for step in range(args.new_tokens):
        # Write this step's keys and values at each sequence's position (a model would compute them
        # from the token it just sampled).
        k_new, v_new = k_all[batch, :, pos], v_all[batch, :, pos]  # [B, Hkv, D]
        if args.paged:
            for b, p in enumerate(pos.tolist()):  # the page allocator lives on the host
                paged.reserve(b, p + 1)
            paged.assign(batch, pos[:, None], k_new[:, :, None], v_new[:, :, None], k_cache, v_cache)
        else:
            k_cache[batch, :, pos] = k_new
            v_cache[batch, :, pos] = v_new

        step_mask = decode_block_mask(full_mask, pos, q_len=1, kv_len=MAX, kv_lengths=kv_len)
        if args.paged:
            step_mask = paged.convert_logical_block_mask(step_mask, batch, kv_len)
        q = q_all[batch, :, pos][:, :, None]  # [B, Hq, 1, D]
        out = flex_attention(q, k_cache, v_cache, score_mod=step_score, block_mask=step_mask, enable_gqa=True)

        want = expected[batch, :, pos][:, :, None]
        err = (out - want).abs().max().item()
        worst = max(worst, err)
        print(f"step {step}: positions {pos.tolist()}, max |out - full-sequence attention| = {err:.2e}")
        if traces_after_first_step is None:
            traces_after_first_step = flexattn.trace.counts.traces
        pos += 1  # in place: the mods built above read the new positions at the next step
        kv_len += 1

    retraced = flexattn.trace.counts.traces - traces_after_first_step
    print(f"traces after the first step: {retraced} (the same mods and kernel served every step)")
    tolerance = 1e-4 if q_all.dtype == torch.float32 and device.type == "cpu" else 2e-3
    if worst > tolerance:
        print(f"FAILED: a step differs from the full-sequence attention by {worst:.2e}", file=sys.stderr)
        return 1
    if retraced:
        print("FAILED: a decoding step traced a mod again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
