"""PagedAttention: the allocator, assign, and paged versus contiguous attention.

Paged attention must give the numbers of attention over each sequence's own contiguous keys: the
oracle is the float64 reference over the contiguous cache with the logical mods.
"""

import inspect
import os

import pytest
import torch
from numerics import rel_err

import flexattn
import flexattn.trace
from flexattn import (
    OutOfPagesError, PagedAttention, create_block_mask, decode_block_mask, flex_attention, offset_mask_mod,
    offset_score_mod,
)
from flexattn.errors import InvalidInputError
from flexattn.reference import reference_attention

CPU = torch.device("cpu")
PYTORCH = {"BACKEND": "PYTORCH"}
TRITON = {"BACKEND": "TRITON"}
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
BACKENDS = [pytest.param(PYTORCH, id="pytorch"), pytest.param(TRITON, id="triton", marks=needs_interpreter)]
pytestmark = pytest.mark.usefixtures("one_thread")

H, E = 2, 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()


def document_causal(doc_ids):
    """Causal attention inside documents packed in each sequence; doc_ids [B, S] (logical positions)."""

    def mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return mask


def fill_cache(paged, rows, lengths, n_slots, k, v, chunk=None):
    """Reserve and write each sequence's keys (in chunks, so pages are interleaved between sequences)."""
    k_cache = torch.randn(1, H, n_slots, E) * 5  # stale contents everywhere else
    v_cache = torch.randn(1, H, n_slots, E) * 5
    chunk = chunk or max(lengths)
    for start in range(0, max(lengths), chunk):
        for i, (row, length) in enumerate(zip(rows, lengths)):
            end = min(start + chunk, length)
            if start >= end:
                continue
            paged.reserve(row, end)
            pos = torch.arange(start, end)[None]
            paged.assign(torch.tensor([row]), pos, k[i:i + 1, :, start:end], v[i:i + 1, :, start:end], k_cache, v_cache)
    return k_cache, v_cache


def reference(q, k, v, lengths, score_mod=None, mask_mod=None):
    """Each sequence over its own first lengths[b] keys, in float64 (mods see the real b)."""
    outs = []
    for b, length in enumerate(lengths):
        sm = None if score_mod is None else (lambda s, _b, h, qi, kv, b=b: score_mod(s, _b + b, h, qi, kv))
        mm = None if mask_mod is None else (lambda _b, h, qi, kv, b=b: mask_mod(_b + b, h, qi, kv))
        outs.append(reference_attention(q[b:b + 1].double(), k[b:b + 1, :, :length].double(),
                                         v[b:b + 1, :, :length].double(), score_mod=sm, mask_mod=mm)[0])
    return torch.cat(outs)


# ------------------------------------------------------------------------------ paged == contiguous


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["causal", "alibi", "document"])
@pytest.mark.parametrize("page_size, block", [(64, 64), (32, 64), (128, 64)], ids=["page_eq_block", "page_lt_block", "page_gt_block"])
def test_paged_equals_contiguous(backend, variant, page_size, block):
    lengths = [70, 200, 33]  # not block multiples, very different
    rows = [3, 0, 1]  # page-table rows that are not 0..B-1
    B, S = len(lengths), max(lengths)
    q, k, v = (torch.randn(B, H, S, E) for _ in range(3))
    n_pages = 12 * 64 // page_size
    paged = PagedAttention(n_pages, page_size, max_batch_size=4, device=CPU)
    k_cache, v_cache = fill_cache(paged, rows, lengths, n_pages * page_size, k, v, chunk=40)
    kv_len = torch.tensor(lengths)

    score_mod, mask_mod = None, causal
    if variant == "alibi":
        score_mod = alibi
    elif variant == "document":
        doc_ids = torch.cat([torch.zeros(B, 25), torch.ones(B, 60), torch.full((B, S - 85), 2.0)], dim=1).int()
        doc_ids[1, 150:] = 7
        mask_mod = document_causal(doc_ids)
    logical = create_block_mask(mask_mod, B, None, S, S, device=CPU, BLOCK_SIZE=block)

    physical = paged.convert_logical_block_mask(logical, torch.tensor(rows), kv_len)
    paged_score = paged.get_score_mod(score_mod, batch_idx=torch.tensor(rows))
    out = flex_attention(q, k_cache, v_cache, score_mod=paged_score, block_mask=physical, kernel_options=backend)

    # The same attention over the contiguous keys, with the logical mask and valid lengths.
    contiguous_mask = create_block_mask(offset_mask_mod(mask_mod, 0, kv_len), B, None, S, S, device=CPU,
                                        BLOCK_SIZE=block)
    contiguous = flex_attention(q, k, v, score_mod=score_mod, block_mask=contiguous_mask, kernel_options=backend)
    expected = reference(q, k, v, lengths, score_mod, mask_mod)
    assert rel_err(out, expected) < 1e-5
    assert rel_err(out, contiguous) < 1e-5
    assert physical.BLOCK_SIZE == (block, min(block, page_size))
    assert physical.seq_lengths == (S, n_pages * page_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_decode_loop_one_trace(backend):
    """Prefill, then decode steps that append a token per sequence, crossing page boundaries."""
    page_size, max_len = 16, 96
    lengths = [15, 40, 3]
    rows = torch.tensor([2, 0, 1])
    B = len(lengths)
    q_all, k_all, v_all = (torch.randn(B, H, max_len, E) for _ in range(3))
    paged = PagedAttention(n_pages=20, page_size=page_size, max_batch_size=3, device=CPU)
    k_cache, v_cache = fill_cache(paged, rows.tolist(), lengths, 20 * page_size, k_all, v_all)
    logical = create_block_mask(causal, None, None, max_len, max_len, device=CPU, BLOCK_SIZE=32)
    pos = torch.tensor(lengths)  # the position of each sequence's next token
    traces = None
    for step in range(4):
        for row, p in zip(rows.tolist(), pos.tolist()):
            paged.reserve(row, p + 1)  # grows by a page when a sequence crosses a page boundary
        index = pos[:, None]
        paged.assign(rows, index, torch.stack([k_all[b][:, pos[b]] for b in range(B)])[:, :, None],
                     torch.stack([v_all[b][:, pos[b]] for b in range(B)])[:, :, None], k_cache, v_cache)
        kv_len = pos + 1
        step_mask = paged.convert_logical_block_mask(decode_block_mask(logical, pos, kv_lengths=kv_len), rows, kv_len)
        score = paged.get_score_mod(offset_score_mod(alibi, pos), batch_idx=rows)
        q = torch.stack([q_all[b][:, pos[b]] for b in range(B)])[:, :, None]
        out = flex_attention(q, k_cache, v_cache, score_mod=score, block_mask=step_mask, kernel_options=backend)
        expected = reference(q, k_all, v_all, kv_len.tolist(), offset_score_mod(alibi, pos), offset_mask_mod(causal, pos))
        assert rel_err(out, expected) < 1e-5, step
        if traces is None:
            traces = flexattn.trace.counts.traces
        assert flexattn.trace.counts.traces == traces, "a decoding step must not retrace the mods"
        pos += 1


def test_paged_mods_alone_mask_other_sequences_and_stale_slots():
    """get_score_mod / get_mask_mod without a converted mask: every physical page is visited, and the
    mods alone must hide pages of other sequences and slots past each valid length."""
    lengths, rows = [50, 90], [1, 0]
    B, S = 2, 90
    q, k, v = (torch.randn(B, H, 8, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E))
    paged = PagedAttention(8, 32, 2, device=CPU)
    k_cache, v_cache = fill_cache(paged, rows, lengths, 8 * 32, k, v, chunk=32)
    kv_len, batch_idx = torch.tensor(lengths), torch.tensor(rows)

    def everything(score, b, h, q_idx, kv_idx):
        return score

    out = flex_attention(q, k_cache, v_cache, score_mod=paged.get_score_mod(everything, kv_len, batch_idx=batch_idx),
                         kernel_options=PYTORCH)
    expected = reference(q, k, v, lengths)
    assert rel_err(out, expected) < 1e-5
    physical_mask = create_block_mask(paged.get_mask_mod(None, kv_len, batch_idx=batch_idx), B, None, 8, 8 * 32,
                                      device=CPU, BLOCK_SIZE=32)
    out = flex_attention(q, k_cache, v_cache, block_mask=physical_mask, kernel_options=PYTORCH)
    assert rel_err(out, expected) < 1e-5


def test_keys_past_the_logical_kv_len_are_masked():
    # A mask for 100 keys over a sequence that owns 128 slots: slots 100..127 hold stale keys.
    paged = PagedAttention(4, 64, 1, device=CPU)
    q, k, v = torch.randn(1, H, 4, E), torch.randn(1, H, 128, E), torch.randn(1, H, 128, E)
    k_cache, v_cache = fill_cache(paged, [0], [128], 4 * 64, k, v)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 4, 100, device=CPU,
                                BLOCK_SIZE=64)
    out = flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                         kernel_options=PYTORCH)
    assert rel_err(out, reference(q, k, v, [100])) < 1e-5


def test_a_batch_one_mask_is_converted_for_every_row():
    paged = PagedAttention(4, 64, 3, device=CPU)
    paged.reserve(0, 64)
    paged.reserve(2, 128)
    logical = create_block_mask(causal, None, None, 128, 128, device=CPU, BLOCK_SIZE=64)
    converted = paged.convert_logical_block_mask(logical)
    assert converted.kv_num_blocks.shape == (3, 1, 2)  # not row 0's pages broadcast to every sequence
    assert converted.to_dense()[:, 0].tolist() == [
        [[1, 0, 0, 0], [1, 0, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]], [[0, 1, 0, 0], [0, 1, 1, 0]]]


def test_converted_torch_block_mask_is_ours():
    import torch.nn.attention.flex_attention as tfa

    paged = PagedAttention(8, 128, 2, device=CPU)
    paged.reserve(1, 300)
    theirs = tfa.create_block_mask(causal, 1, None, 300, 300, device=CPU)
    converted = paged.convert_logical_block_mask(theirs, torch.tensor([1]))
    assert isinstance(converted, flexattn.BlockMask)
    assert converted.to_dense()[0, 0].tolist() == [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0],
                                                    [1, 1, 1, 0, 0, 0, 0, 0]]


def test_unowned_blocks_are_dropped_even_when_full():
    # A logical mask that lists every block, over a sequence that owns only its first page.
    paged = PagedAttention(4, 64, 2, device=CPU)
    paged.reserve(0, 64)  # page 0 -> row 0
    paged.reserve(1, 128)  # pages 1, 2 -> row 1
    logical = create_block_mask(lambda b, h, q, kv: q >= 0, 2, None, 64, 256, device=CPU, BLOCK_SIZE=64)
    converted = paged.convert_logical_block_mask(logical)
    dense = converted.to_dense()[:, 0, 0]
    assert dense.tolist() == [[1, 0, 0, 0], [0, 1, 1, 0]]
    assert converted.full_kv_num_blocks[:, 0, 0].tolist() == [1, 2]  # whole owned pages stay full


# ------------------------------------------------------------------------------ the allocator


def test_reserve_erase_assign_round_trip():
    paged = PagedAttention(n_pages=6, page_size=4, max_batch_size=3, device=CPU)
    paged.reserve(0, 5)  # two pages
    paged.reserve(torch.tensor([2]), torch.tensor(3))  # torch's tensor arguments work too
    paged.reserve(0, 8)  # already held: nothing new
    assert paged.page_table[0, :2].tolist() == [0, 1] and paged.page_table[2, :1].tolist() == [2]
    assert paged.capacity.tolist() == [8, 0, 4]
    assert paged.physical_to_logical[0, :3].tolist() == [0, 1, -1]
    assert paged.empty_pages == [5, 4, 3]
    k_cache, v_cache = torch.zeros(1, 2, 24, 3), torch.zeros(1, 2, 24, 3)
    k_val, v_val = torch.randn(2, 2, 3, 3), torch.randn(2, 2, 3, 3)
    paged.assign(torch.tensor([0, 2]), torch.tensor([[2, 4, 7], [0, 1, 3]]), k_val, v_val, k_cache, v_cache)
    # Row 0's positions 2, 4, 7 live in pages 0, 1, 1 at slots 2, 4, 7; row 2's in page 2 (slots 8..11).
    assert torch.equal(k_cache[0, :, [2, 4, 7]], k_val[0]) and torch.equal(v_cache[0, :, [8, 9, 11]], v_val[1])
    assert int((k_cache != 0).any(dim=(0, 1, 3)).sum()) == 6

    paged.erase(0)
    assert paged.page_table[0].tolist() == [-1] * 6 and paged.capacity[0] == 0
    assert (paged.physical_to_logical[0] == -1).all()
    paged.reserve(1, 12)  # three pages: the two just freed come back first
    assert paged.page_table[1, :3].tolist() == [0, 1, 3]
    assert paged.physical_to_logical[1, [0, 1, 3]].tolist() == [0, 1, 2]
    with pytest.raises(OutOfPagesError, match="needs 3 more pages of 4 tokens but only 2 of 6 are free"):
        paged.reserve(2, 16)
    with pytest.raises(InvalidInputError, match="no page reserved"):
        paged.assign(torch.tensor([2]), torch.tensor([[4]]), k_val[:1, :, :1], v_val[:1, :, :1], k_cache, v_cache)
    with pytest.raises(InvalidInputError, match=r"k_cache must have shape \(1, 2, 24, 3\)"):
        paged.assign(torch.tensor([2]), torch.tensor([[0]]), k_val[:1, :, :1], v_val[:1, :, :1], k_cache[:, :, :20],
                     v_cache)
    with pytest.raises(InvalidInputError, match="outside the page table's rows"):
        paged.reserve(3, 1)


def test_page_sizes_that_do_not_fit_the_block_are_an_error():
    paged = PagedAttention(4, 48, 1, device=CPU)
    logical = create_block_mask(causal, None, None, 128, 128, device=CPU, BLOCK_SIZE=64)
    with pytest.raises(InvalidInputError, match="page_size 48 and the BlockMask's KV block size 64 must divide"):
        paged.convert_logical_block_mask(logical)


def test_method_names_and_arguments_follow_torch():
    from torch.nn.attention.experimental._paged_attention import PagedAttention as TorchPaged

    for name in ("__init__", "reserve", "erase", "assign", "convert_logical_block_mask", "get_mask_mod",
                 "get_score_mod"):
        ours = [p for p in inspect.signature(getattr(PagedAttention, name)).parameters.values()
                if p.kind != p.KEYWORD_ONLY]
        theirs = list(inspect.signature(getattr(TorchPaged, name)).parameters.values())
        assert [p.name for p in ours] == [p.name for p in theirs], name


@pytest.mark.gpu
def test_decode_step_path_has_no_host_sync():
    """decode_block_mask, convert_logical_block_mask, assign and the offset mods never wait for the GPU."""
    device = torch.device("cuda")
    paged = PagedAttention(64, 64, 4, device=device)
    for row in range(4):
        paged.reserve(row, 1000)
    k_cache = torch.randn(1, H, 64 * 64, E, device=device)
    v_cache = torch.randn(1, H, 64 * 64, E, device=device)
    logical = create_block_mask(causal, None, None, 1024, 1024, device=device, BLOCK_SIZE=128)
    rows = torch.tensor([2, 0, 3, 1], device=device)
    pos = torch.tensor([5, 300, 700, 999], device=device)
    k_val, v_val = torch.randn(4, H, 1, E, device=device), torch.randn(4, H, 1, E, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged.assign(rows, pos[:, None], k_val, v_val, k_cache, v_cache)
        step = decode_block_mask(logical, pos, kv_lengths=pos + 1)
        step = paged.convert_logical_block_mask(step, rows, pos + 1)
        score = paged.get_score_mod(offset_score_mod(alibi, pos), batch_idx=rows)
        sliced = logical[:, :, pos[0] // 128]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    q = torch.randn(4, H, 1, E, device=device)
    out = flex_attention(q, k_cache, v_cache, score_mod=score, block_mask=step)  # first call: compiles
    assert torch.isfinite(out).all() and sliced.kv_num_blocks.shape == (1, 1, 1)

    # The next step, end to end: new positions, a new step mask, its paged conversion and the decode
    # launch itself, with no host sync anywhere.
    pos2 = pos + 1
    q2 = torch.randn(4, H, 1, E, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged.assign(rows, pos2[:, None], k_val, v_val, k_cache, v_cache)
        step2 = paged.convert_logical_block_mask(decode_block_mask(logical, pos2, kv_lengths=pos2 + 1), rows, pos2 + 1)
        out2 = flex_attention(q2, k_cache, v_cache, score_mod=score, block_mask=step2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out2).all()
