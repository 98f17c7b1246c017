"""PagedAttention: the allocator, assign, and paged versus contiguous attention.

Paged attention must give the numbers of attention over each sequence's own contiguous keys: the
oracle is the float64 reference over the contiguous cache with the logical mods.
"""

import inspect
import os
import random

import pytest
import torch
from numerics import rel_err
from torch.utils._python_dispatch import TorchDispatchMode

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
ALL_BACKENDS = BACKENDS + [pytest.param({"BACKEND": "TRITON_DECODE"}, id="triton_decode", marks=needs_interpreter)]
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


# ------------------------------------------------------------------------------ tables written by hand
# page_table and physical_to_logical are the allocator's. An entry written by hand that points at another
# sequence's page, a free page or past the cache is an InvalidInputError naming the entry, before any
# backend reads keys ([Note] Table checks in flexattn/paged_attention.py).


def everything_after_two_blocks(b, h, q_idx, kv_idx):
    """Keys 0..31 in full blocks (16-key pages), a pattern after them: full and partial blocks both."""
    return (kv_idx < 32) | (kv_idx % 3 != q_idx % 2)


def random_paged_cache(rng, n_pages=14, page_size=16, rows=3):
    """Reserve and erase at random (pages scattered among the rows), then fill each row's keys."""
    paged = PagedAttention(n_pages, page_size, rows, device=CPU)
    lengths = [0] * rows
    for _ in range(10):
        row = rng.randrange(rows)
        if lengths[row] and rng.random() < 0.3:
            paged.erase(row)
            lengths[row] = 0
        else:
            grown = lengths[row] + rng.randint(1, 40)
            if (len(paged.empty_pages) - 1) * page_size >= grown - int(paged.capacity[row]):  # one page stays free
                paged.reserve(row, grown)
                lengths[row] = grown
    for row in range(rows):  # every row holds at least one key
        if lengths[row] == 0:
            paged.reserve(row, 5)
            lengths[row] = 5
    S = max(lengths)
    k, v = torch.randn(rows, H, S, E), torch.randn(rows, H, S, E)
    k_cache, v_cache = torch.randn(1, H, n_pages * page_size, E) * 5, torch.randn(1, H, n_pages * page_size, E) * 5
    for row, length in enumerate(lengths):
        paged.assign(torch.tensor([row]), torch.arange(length)[None], k[row:row + 1, :, :length],
                     v[row:row + 1, :, :length], k_cache, v_cache)
    return paged, lengths, k, v, k_cache, v_cache


def paged_step(paged, lengths, q, k_cache, v_cache, backend):
    """One attention call over the paged cache: convert the logical mask, then flex_attention."""
    S = max(lengths)
    logical = create_block_mask(everything_after_two_blocks, None, None, q.shape[2], S, device=CPU,
                                BLOCK_SIZE=(16, 16))
    physical = paged.convert_logical_block_mask(logical, kv_len=torch.tensor(lengths))
    return flex_attention(q, k_cache, v_cache, block_mask=physical, kernel_options=backend)


def own_keys(cache, slots):
    """[len(slots), H, longest, E]: row b holds cache slots slots[b] (a range), zero-padded."""
    longest = max(len(r) for r in slots)
    out = torch.zeros(len(slots), cache.shape[1], longest, cache.shape[3])
    for b, r in enumerate(slots):
        out[b, :, :len(r)] = cache[0, :, r.start:r.stop]
    return out


def corrupt(rng, paged, kind):
    """Write one wrong table entry by hand; returns the undo and the error message it must raise."""
    held = {page: row for row, pages in enumerate(paged.page_table.tolist()) for page in pages if page >= 0}
    row = rng.randrange(paged.max_batch_size)
    logical = rng.randrange(int(paged.capacity[row]) // paged.page_size + 1)  # a held entry, or the first past them
    table, entry = paged.page_table, (row, logical)
    if kind == "foreign":
        page = rng.choice([p for p, r in held.items() if r != row])
        expected = rf"page {page} belongs to sequence {held[page]}"
    elif kind == "out_of_range":
        page = paged.n_pages + rng.randrange(3)
        expected = rf"{page} is not a page of the cache \(pages are 0..{paged.n_pages - 1}"
    elif kind == "unassigned":
        page = rng.choice(paged.empty_pages)
        expected = rf"page {page} is free"
    else:  # "claimed": physical_to_logical says the row holds another row's page
        page = rng.choice([p for p, r in held.items() if r != row])
        table, entry = paged.physical_to_logical, (row, page)
        expected = rf"physical_to_logical\[{row}, {page}\] \(sequence {row}, page {page}\) = {logical}, but " \
                   rf"sequence {row} does not hold page {page}"
        page = logical
    if table is paged.page_table:
        expected = rf"page_table\[{row}, {logical}\] \(sequence {row}, logical page {logical}\) = {page}: " + expected
    old = int(table[entry])
    table[entry] = page

    def undo():
        table[entry] = old

    return undo, expected


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_foreign_page_in_a_full_block_is_an_error_on_every_backend(backend):
    # Row 0 holds page 0, row 1 pages 1 and 2. By hand, row 0's logical page 1 points at row 1's page
    # 2: a full block there skipped the mask_mod's ownership test and read row 1's keys.
    paged = PagedAttention(4, 64, 2, device=CPU)
    paged.reserve(0, 64)
    paged.reserve(1, 128)
    q, k_cache, v_cache = torch.randn(2, H, 64, E), torch.randn(1, H, 256, E), torch.randn(1, H, 256, E)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, 2, None, 64, 128, device=CPU,
                                BLOCK_SIZE=64)
    paged.page_table[0, 1] = 2
    with pytest.raises(InvalidInputError, match=r"convert_logical_block_mask: page_table\[0, 1\] \(sequence 0, "
                       r"logical page 1\) = 2: page 2 belongs to sequence 1 \(its logical page 1\); sequence 0 "
                       r"holds 1 page, so the entry must be -1"):
        flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                       kernel_options=backend)
    # Past the cache: the Triton kernels read beyond its end, the PyTorch backend dropped the block.
    paged.page_table[0, 1] = 7
    with pytest.raises(InvalidInputError, match=r"= 7: 7 is not a page of the cache \(pages are 0..3, -1 for none\)"):
        flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                       kernel_options=backend)
    with pytest.raises(InvalidInputError, match=r"assign: page_table\[0, 1\]"):
        paged.assign(torch.tensor([0]), torch.tensor([[70]]), torch.randn(1, H, 1, E), torch.randn(1, H, 1, E),
                     k_cache, v_cache)
    paged.page_table[0, 1] = -1  # undone: the tables are the allocator's again
    out = flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                         kernel_options=backend)
    slots = [range(0, 64), range(64, 192)]
    assert rel_err(out, reference(q, own_keys(k_cache, slots), own_keys(v_cache, slots), [64, 128])) < 1e-5


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_write_the_host_check_cannot_see_reads_nothing_from_the_wrong_place(backend):
    # A write through .data bumps no version counter, so the host check does not run; the conversion's
    # own ownership test on the device drops the foreign and the out-of-range page on every backend.
    paged = PagedAttention(4, 64, 2, device=CPU)
    paged.reserve(0, 64)
    paged.reserve(1, 128)
    q, k_cache, v_cache = torch.randn(2, H, 64, E), torch.randn(1, H, 256, E), torch.randn(1, H, 256, E)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, 2, None, 64, 128, device=CPU,
                                BLOCK_SIZE=64)
    paged.page_table.data[0, 1] = 2  # row 1's page
    paged.page_table.data[1, 1] = 9  # past the cache
    physical = paged.convert_logical_block_mask(logical)
    assert physical.to_dense()[:, 0, 0].tolist() == [[1, 0, 0, 0], [0, 1, 0, 0]]
    out = flex_attention(q, k_cache, v_cache, block_mask=physical, kernel_options=backend)
    slots = [range(0, 64), range(64, 128)]  # each row's first page; the second is dropped
    expected = reference(q, own_keys(k_cache, slots), own_keys(v_cache, slots), [64, 64])
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("seed", range(2))
def test_random_page_tables_match_dense_and_random_corruptions_raise(backend, seed):
    rng = random.Random(seed)
    paged, lengths, k, v, k_cache, v_cache = random_paged_cache(rng)
    q = torch.randn(len(lengths), H, 16, E)
    out = paged_step(paged, lengths, q, k_cache, v_cache, backend)
    assert rel_err(out, reference(q, k, v, lengths, mask_mod=everything_after_two_blocks)) < 1e-5
    for kind in ("foreign", "out_of_range", "unassigned", "claimed") * 2:
        undo, expected = corrupt(rng, paged, kind)
        with pytest.raises(InvalidInputError, match="convert_logical_block_mask: " + expected):
            paged_step(paged, lengths, q, k_cache, v_cache, backend)
        undo()
    assert torch.equal(paged_step(paged, lengths, q, k_cache, v_cache, backend), out)


class _CountReads(TorchDispatchMode):
    """Counts nonzero and item calls: what the table check's read to the host runs."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_tables_are_read_back_once_per_write_by_hand_not_per_step():
    paged = PagedAttention(8, 16, 2, device=CPU)
    paged.reserve(0, 40)
    paged.reserve(1, 20)
    logical = create_block_mask(causal, None, None, 64, 64, device=CPU, BLOCK_SIZE=16)

    def step():
        with _CountReads() as counter:
            paged.convert_logical_block_mask(logical, kv_len=torch.tensor([40, 20]))
            paged.get_score_mod(alibi)
        return counter.reads

    assert step() == 0  # the allocator's own writes are stamped
    paged.page_table[1, 0] = paged.page_table[1, 0].clone()  # a write by hand, of the same value
    assert step() > 0  # checked once (and found right) ...
    assert step() == 0  # ... then stamped again
    paged.reserve(1, 40)
    paged.erase(0)
    assert step() == 0


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
