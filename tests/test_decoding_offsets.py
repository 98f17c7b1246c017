"""Decoding offsets: shifted mods, per-sequence valid lengths, the step's BlockMask, row slicing.

The oracle is always the float64 reference over the *whole* sequence at absolute positions: the
rows of a decoding step must equal the matching rows of attention over the full sequence.
"""

import os

import pytest
import torch
from numerics import rel_err

import flexattn
import flexattn.trace
from flexattn import (
    create_block_mask, decode_block_mask, flex_attention, offset_mask_mod, offset_score_mod,
)
from flexattn.masks import sliced_rows_mask_mod
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


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()


def full_sequence_rows(q_full, k, v, positions, score_mod=None, mask_mod=None, lengths=None):
    """Reference rows at absolute ``positions [B, q_len]``: attention over the whole sequence, keys of
    sequence b limited to its first lengths[b] (the oracle never sees an offset)."""
    rows = []
    for b in range(q_full.shape[0]):
        S = k.shape[2] if lengths is None else int(lengths[b])

        def at_batch_b(fn, with_score):
            # The reference calls mods with b = 0: give them the real batch index.
            if fn is None:
                return None
            if with_score:
                return lambda s, _b, h, q, kv: fn(s, _b + b, h, q, kv)
            return lambda _b, h, q, kv: fn(_b + b, h, q, kv)

        out, _, _ = reference_attention(
            q_full[b:b + 1].double(), k[b:b + 1, :, :S].double(), v[b:b + 1, :, :S].double(),
            score_mod=at_batch_b(score_mod, True), mask_mod=at_batch_b(mask_mod, False),
        )
        rows.append(out[:, :, positions[b]])
    return torch.cat(rows)


def step_queries(q_full, positions):
    """q_full[b, :, positions[b]] for every b: the step's queries [B, H, q_len, E]."""
    return torch.stack([q_full[b][:, positions[b]] for b in range(q_full.shape[0])])


# ------------------------------------------------------------------------------ shifted mods


@pytest.mark.parametrize("backend", BACKENDS)
def test_offset_mods_match_the_reference_at_absolute_positions(backend):
    B, H, S, E, q_len = 2, 2, 200, 16, 3
    q_full, k, v = (torch.randn(B, H, S, E) for _ in range(3))
    offset = 117
    positions = torch.arange(offset, offset + q_len).expand(B, q_len)
    q = step_queries(q_full, positions)
    mask = offset_mask_mod(sliding_window, offset, device=CPU)
    score = offset_score_mod(alibi, offset, device=CPU)
    # No BlockMask sparsity here: the mask_mod alone must be right at every position.
    bm = create_block_mask(mask, B, H, q_len, S, device=CPU, BLOCK_SIZE=64)
    out = flex_attention(q, k, v, score_mod=score, block_mask=bm, kernel_options=backend)
    expected = full_sequence_rows(q_full, k, v, positions, alibi, sliding_window)
    assert rel_err(out, expected) < 1e-5


def near(b, h, q_idx, kv_idx):
    """Not causal: a query also sees later keys, so only the valid lengths keep stale slots out."""
    return (q_idx - kv_idx).abs() < 60


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_batch_offsets_and_valid_lengths(backend):
    B, H, S, E = 3, 2, 160, 16
    q_full, k, v = (torch.randn(B, H, S, E) for _ in range(3))
    offsets = torch.tensor([5, 100, 150], dtype=torch.int32)
    lengths = torch.tensor([40, 101, 160], dtype=torch.int32)
    cache_k, cache_v = k.clone(), v.clone()
    for b in range(B):  # slots past a sequence's length hold stale keys that must be ignored
        cache_k[b, :, int(lengths[b]):] = 30.0
        cache_v[b, :, int(lengths[b]):] = 1e4
    q = step_queries(q_full, offsets[:, None].long())
    mask = offset_mask_mod(near, offsets, lengths)
    score = offset_score_mod(alibi, offsets)
    bm = create_block_mask(mask, B, None, 1, S, device=CPU, BLOCK_SIZE=32)
    out = flex_attention(q, cache_k, cache_v, score_mod=score, block_mask=bm, kernel_options=backend)
    expected = full_sequence_rows(q_full, k, v, offsets[:, None].long(), alibi, near, lengths)
    assert rel_err(out, expected) < 1e-5
    # The score_mod alone also hides the stale slots (-inf past the length), with no mask at all.
    score_only = offset_score_mod(lambda s, b, h, q_idx, kv_idx: torch.where(near(b, h, q_idx, kv_idx), s, -float("inf")),
                                  offsets, lengths)
    out = flex_attention(q, cache_k, cache_v, score_mod=score_only, kernel_options=PYTORCH)
    expected = full_sequence_rows(q_full, k, v, offsets[:, None].long(), None, near, lengths)
    assert rel_err(out, expected) < 1e-5


def test_offset_arguments_are_checked():
    with pytest.raises(InvalidInputError, match="offset must be an int or an integer tensor"):
        offset_mask_mod(causal, torch.tensor(1.5))
    with pytest.raises(InvalidInputError, match="1-d tensor"):
        offset_mask_mod(causal, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(InvalidInputError, match="takes 5 arguments: that is a score_mod"):
        offset_mask_mod(alibi, 3)
    with pytest.raises(InvalidInputError, match="that is a mask_mod"):
        offset_score_mod(causal, 3)
    with pytest.raises(InvalidInputError, match="must be >= 0"):
        offset_mask_mod(causal, -1)


def test_tensors_are_read_not_copied():
    offset = torch.tensor(3, dtype=torch.int32)
    mod = offset_mask_mod(causal, offset)
    one = torch.tensor(0, dtype=torch.int32)
    assert bool(mod(one, one, one, torch.tensor(3)))
    offset += 1  # an in-place update reaches the same mod
    assert bool(mod(one, one, one, torch.tensor(4))) and not bool(mod(one, one, one, torch.tensor(5)))


# ------------------------------------------------------------------------------ the step's BlockMask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_loop_one_trace_and_exact_rows(backend, q_len):
    B, H, S, E = 3, 2, 256, 16
    q_full, k, v = (torch.randn(B, H, S, E) for _ in range(3))
    full_mask = create_block_mask(causal, None, None, S, S, device=CPU, BLOCK_SIZE=64)
    # Per-sequence positions, one straddling a block boundary (62..65 for q_len 4).
    pos = torch.tensor([0, 62, 200], dtype=torch.int32)
    lengths = pos + q_len
    traces = None
    for step in range(4):
        positions = pos[:, None].long() + torch.arange(q_len)
        step_mask = decode_block_mask(full_mask, pos, q_len=q_len, kv_lengths=lengths)
        score = offset_score_mod(alibi, pos)
        q = step_queries(q_full, positions)
        out = flex_attention(q, k, v, score_mod=score, block_mask=step_mask, kernel_options=backend)
        expected = full_sequence_rows(q_full, k, v, positions, alibi, causal, lengths)
        assert rel_err(out, expected) < 1e-5, step
        if traces is None:
            traces = flexattn.trace.counts.traces
        assert flexattn.trace.counts.traces == traces, "a new position must not retrace the mods"
        pos += 1
        lengths += 1


def test_decode_block_mask_tables():
    S = 512
    full_mask = create_block_mask(causal, None, None, S, S, device=CPU, BLOCK_SIZE=128)
    # q_len 1 at position 300: the row of block 2, key blocks 0 and 1 full, 2 partial.
    step = decode_block_mask(full_mask, 300)
    assert step.seq_lengths == (1, S) and step.kv_num_blocks.shape == (1, 1, 1)
    assert step.full_kv_indices[0, 0, 0, :step.full_kv_num_blocks[0, 0, 0]].tolist() == [0, 1]
    assert step.kv_indices[0, 0, 0, :step.kv_num_blocks[0, 0, 0]].tolist() == [2]
    assert step.q_indices is None  # inference only
    # The same blocks as torch-style row slicing, which keeps seq_lengths and drops the mask_mod.
    sliced = full_mask[:, :, 300 // 128]
    assert sliced.seq_lengths == (S, S) and sliced.mask_mod is sliced_rows_mask_mod
    assert torch.equal(sliced.to_dense(), step.to_dense())
    # Four queries at 126..129 straddle rows 0 and 1: key block 0 is full in row 1 only -> partial.
    step = decode_block_mask(full_mask, 126, q_len=4)
    assert step.full_kv_num_blocks.sum() == 0
    assert step.kv_indices[0, 0, 0, :step.kv_num_blocks[0, 0, 0]].tolist() == [0, 1]
    # Valid lengths drop key blocks wholly past them and make the cut block partial.
    step = decode_block_mask(full_mask, torch.tensor([500, 500]), kv_lengths=torch.tensor([300, 100]))
    assert step.kv_num_blocks.shape == (2, 1, 1)
    assert step.full_kv_indices[0, 0, 0, :step.full_kv_num_blocks[0, 0, 0]].tolist() == [0, 1]
    assert step.kv_indices[0, 0, 0, :step.kv_num_blocks[0, 0, 0]].tolist() == [2]
    assert step.full_kv_num_blocks[1].sum() == 0
    assert step.kv_indices[1, 0, 0, :step.kv_num_blocks[1, 0, 0]].tolist() == [0]
    # A shorter call (kv_len) crops the key blocks.
    step = decode_block_mask(full_mask, 500, kv_len=200)
    assert step.seq_lengths == (1, 200)
    assert step.full_kv_indices[0, 0, 0, :step.full_kv_num_blocks[0, 0, 0]].tolist() == [0]
    assert step.kv_indices[0, 0, 0, :step.kv_num_blocks[0, 0, 0]].tolist() == [1]


def test_decode_block_mask_takes_torch_masks():
    import torch.nn.attention.flex_attention as tfa

    theirs = tfa.create_block_mask(causal, None, None, 256, 256, device=CPU)
    step = decode_block_mask(theirs, 200)
    assert isinstance(step, flexattn.BlockMask)
    assert step.to_dense().tolist() == [[[[1, 1]]]]


def test_decode_block_mask_errors():
    full_mask = create_block_mask(causal, None, None, 256, 256, device=CPU, BLOCK_SIZE=64)
    with pytest.raises(InvalidInputError, match="past the block_mask's Q_LEN=256"):
        decode_block_mask(full_mask, 254, q_len=4)
    with pytest.raises(InvalidInputError, match=r"offset \+ q_len \(1\) must lie in \[0, Q_LEN=256\]"):
        decode_block_mask(full_mask, torch.tensor([3, 256]))
    with pytest.raises(InvalidInputError, match="not one whose rows were"):
        decode_block_mask(full_mask[:, :, 1], 3)
    with pytest.raises(InvalidInputError, match="built for Q_LEN=256, KV_LEN=256"):
        decode_block_mask(full_mask, 3, kv_len=300)
    with pytest.raises(InvalidInputError, match="batch sizes"):
        decode_block_mask(create_block_mask(causal, 2, None, 256, 256, device=CPU), torch.tensor([1, 2, 3]))


# ------------------------------------------------------------------------------ row slicing


def test_row_slicing_with_a_tensor_matches_torch():
    import torch.nn.attention.flex_attention as tfa

    ours = create_block_mask(sliding_window, 2, 2, 512, 512, device=CPU, BLOCK_SIZE=128)
    theirs = tfa.create_block_mask(sliding_window, 2, 2, 512, 512, device=CPU)
    rows = torch.tensor([3, -3])  # negative counts from the end, as in torch
    mine, torch_rows = ours[:, :, rows], theirs[:, :, rows]
    assert mine.seq_lengths == torch_rows.seq_lengths == (512, 512)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(torch_rows, name)), name
    for num, name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n = getattr(mine, num)
        used = torch.arange(4) < n.unsqueeze(-1)
        assert torch.equal(getattr(mine, name)[used], getattr(torch_rows, name)[used].int()), name
    with pytest.raises(RuntimeError, match="decode_block_mask"):
        mine.mask_mod(*(torch.tensor(0),) * 4)
    with pytest.raises(IndexError, match="out of range"):
        ours[:, :, torch.tensor([4])]


def test_row_sliced_mask_with_the_wrong_lengths_points_to_decode_block_mask():
    from flexattn.errors import InvalidInputError

    full = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 256, 256, device="cpu",
                             BLOCK_SIZE=64)
    step = full[:, :, 2]  # seq_lengths stay (256, 256), as in torch
    q = torch.randn(1, 2, 1, 16)
    k = v = torch.randn(1, 2, 256, 16)
    with pytest.raises(InvalidInputError, match="decode_block_mask"):
        flex_attention(q, k, v, block_mask=step)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton backends on CPU tensors: the interpreter only")
def test_decode_step_masks_skip_the_launch_table_checks(monkeypatch):
    """decode_block_mask's masks carry their launch tables (built from dense maps, valid by
    construction), so a step never runs the checks that cost a host sync on a GPU; a table changed
    in place afterwards is checked again."""
    import flexattn.kernels.tables as runtime

    calls = []
    real = runtime._compute_launch_tables
    monkeypatch.setattr(runtime, "_compute_launch_tables", lambda bm: calls.append(bm) or real(bm))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    B, H, S, E = 2, 2, 256, 16
    full = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=64)
    k, v = torch.randn(B, H, S, E), torch.randn(B, H, S, E)
    pos = torch.tensor([37, 200])
    for backend in ("TRITON_DECODE", "TRITON", "PYTORCH"):
        step = decode_block_mask(full, pos, kv_lengths=pos + 1)
        q = torch.randn(B, H, 1, E)
        out = flex_attention(q, k, v, block_mask=step, kernel_options={"BACKEND": backend})
        expected = reference_attention(q.double(), k.double(), v.double(), mask_mod=step.mask_mod)[0]
        assert rel_err(out, expected) < 1e-5, backend
    assert not [bm for bm in calls if bm.seq_lengths == (1, S)]
    step.kv_num_blocks[0, 0, 0] = 0  # changed in place: the stamp fails and the checks run again
    flex_attention(torch.randn(B, H, 1, E), k, v, block_mask=step, kernel_options={"BACKEND": "TRITON"})
    assert [bm for bm in calls if bm is step]
