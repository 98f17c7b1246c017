"""The split-KV decode kernels (BACKEND='TRITON_DECODE') against the float64 reference.

Without a GPU these run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
shapes are small; tests/test_gpu_decode.py repeats the important cases at realistic sizes. Every
numerical test also checks that the decode kernels, not the forward kernel, ran.
"""

import contextlib

import pytest
import torch
from numerics import rel_err

import flexattn
import flexattn.kernels.decode
from flexattn import AuxRequest, BlockMask, create_block_mask, flex_attention
from flexattn.dispatch import choose_decode as _dispatch_decode
from flexattn.errors import InvalidInputError
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE, causal_mask, generate_alibi_bias, generate_tanh_softcap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def expect_decode(runs=True):
    before = flexattn.kernels.decode.launches
    yield
    grew = flexattn.kernels.decode.launches > before
    assert grew == runs, "the decode kernels ran" if grew else "the decode kernels did not run"


def qkv(B, Hq, Hkv, L, S, E=32, Ev=None, dtype=torch.float32, kv_batch=None):
    kv_batch = B if kv_batch is None else kv_batch
    q = torch.randn(B, Hq, L, E, device=DEVICE, dtype=dtype)
    k = torch.randn(kv_batch, Hkv, S, E, device=DEVICE, dtype=dtype)
    v = torch.randn(kv_batch, Hkv, S, Ev or E, device=DEVICE, dtype=dtype)
    return q, k, v


def shifted(score_mod, mask_mod, offset):
    """The mods of a square (S, S) problem as seen by L queries at positions offset .. offset + L - 1:
    what decoding the last L tokens of a sequence computes."""
    score = mask = None
    if score_mod is not None:
        def score(s, b, h, q_idx, kv_idx):
            return score_mod(s, b, h, q_idx + offset, kv_idx)
    if mask_mod is not None:
        def mask(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + offset, kv_idx)
    return score, mask


def check_decode(q, k, v, score_mod, mask_mod, *, block_mask=None, block_size=128, splits=None, mask_heads=None,
                 mask_batch=None, scale=None):
    """Decode output and LSE against the float64 reference; returns the plan the launch used."""
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    if block_mask is None and mask_mod is not None:
        block_mask = create_block_mask(mask_mod, mask_batch, mask_heads, L, S, device=q.device, BLOCK_SIZE=block_size)
    options = {"BACKEND": "TRITON_DECODE"}
    if splits is not None:
        options["DECODE_NUM_SPLITS"] = splits
    with expect_decode():
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=Hq != k.shape[1], kernel_options=options,
                                  return_aux=AuxRequest(lse=True))
    ref_out, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                              mask_mod=mask_mod, scale=scale, enable_gqa=Hq != k.shape[1])
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and out.shape == ref_out.shape and aux.lse.shape == (B, Hq, L)
    assert not torch.isnan(out).any(), "NaN in the output (an element the kernels never wrote?)"
    assert rel_err(out, ref_out) < tol
    assert rel_err(aux.lse, ref_lse) < max(tol, 1e-5)
    assert aux.max_scores is None
    return _last_plan()


def _last_plan():
    # The decode kernel that just ran is the most recently used entry of the kernel cache.
    kernel = next(reversed(flexattn.kernels.decode._kernels.values()))
    return kernel.last_plan


@pytest.mark.parametrize("q_len", [1, 3, 16])
@pytest.mark.parametrize("variant", [name for name, v in CATALOGUE.items() if v.paper])
def test_catalogue_decoding(variant, q_len):
    # The paper's variants; tests/test_variants.py decodes every catalogue entry with decode=True.
    # The last q_len tokens of a 300-token sequence (not a block multiple), 6 query heads on 2
    # key/value heads, three splits.
    B, Hq, Hkv, S = 2, 6, 2, 300
    score_mod, mask_mod = CATALOGUE[variant].build(B, Hq, S, S, DEVICE)
    score_mod, mask_mod = shifted(score_mod, mask_mod, S - q_len)
    q, k, v = qkv(B, Hq, Hkv, q_len, S)
    plan = check_decode(q, k, v, score_mod, mask_mod, block_size=64 if q_len == 3 else 128, splits=3)
    assert plan.constexprs("partial")["HEADS"] == 3 and plan.constexprs("partial")["NUM_SPLITS"] == 3


@pytest.mark.parametrize("q_len", [33, 64])
def test_query_lengths_the_automatic_choice_takes(q_len):
    # AUTO (on CUDA) takes the decode kernels up to decode.MAX_AUTO_QUERY_LEN = 64 rows; 4 heads x 33
    # queries are more rows than one 128-row tile, so the group is cut into row tiles.
    B, Hq, Hkv, S = 2, 8, 2, 333
    score_mod, mask_mod = shifted(generate_alibi_bias(Hq, DEVICE), causal_mask, S - q_len)
    q, k, v = qkv(B, Hq, Hkv, q_len, S)
    plan = check_decode(q, k, v, score_mod, mask_mod)
    assert plan.constexprs("partial")["ROW_TILES"] == 2 and plan.constexprs("partial")["HEADS"] == 4


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("ratio", [1, 3, 4, 6, 8])
def test_gqa_ratios(ratio, q_len):
    Hkv = 2 if ratio <= 4 else 1
    Hq = Hkv * ratio
    S = 200
    q, k, v = qkv(2, Hq, Hkv, q_len, S, E=64)
    score_mod, mask_mod = shifted(generate_alibi_bias(Hq, DEVICE), causal_mask, S - q_len)
    plan = check_decode(q, k, v, score_mod, mask_mod, block_size=64, splits=2)
    # One program per group: every query head of the group in one tile, K/V read once.
    assert plan.constexprs("partial")["HEADS"] == ratio and plan.steps["partial"].grid[1] == Hkv


def test_many_splits_merge_in_chunks(monkeypatch):
    # 70 splits merged 16 at a time (five steps, the last one partial; smaller steps than on a GPU,
    # so that few splits exercise the loop), by programs that each own 16 of the 64 output columns;
    # a few splits own no block at all (132 blocks over 70 splits).
    monkeypatch.setattr(flexattn.kernels.decode, "MERGE_STEP_ELEMENTS", 512)
    S = 2100
    q, k, v = qkv(1, 4, 2, 2, S, E=64)
    score_mod, mask_mod = shifted(generate_alibi_bias(4, DEVICE), causal_mask, S - 2)
    plan = check_decode(q, k, v, score_mod, mask_mod, block_size=16, splits=70)
    merge = plan.constexprs("merge")
    assert merge["SPLIT_CHUNK"] == 16 and merge["D_CHUNKS"] == 4 and merge["MERGE_D"] == 16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_and_odd_head_dims(dtype):
    q, k, v = qkv(2, 4, 2, 2, 300, E=48, Ev=40, dtype=dtype)
    score_mod, mask_mod = shifted(generate_tanh_softcap(20.0), causal_mask, 298)
    check_decode(q, k, v, score_mod, mask_mod, block_size=64, splits=4)


@pytest.mark.parametrize("splits", [1, 2, 5, 9])
def test_split_counts(splits):
    # 300 keys in blocks of 64: 5 listed blocks; 9 splits leave some programs nothing to do.
    q, k, v = qkv(1, 4, 1, 1, 300)
    plan = check_decode(q, k, v, generate_alibi_bias(4, DEVICE), None, splits=splits, block_size=64)
    assert ("merge" not in plan.steps) == (splits == 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the split count follows its SMs (tested above)")
def test_default_split_count_under_the_interpreter():
    q, k, v = qkv(1, 2, 2, 1, 300)
    plan = check_decode(q, k, v, None, None)
    assert plan.constexprs("partial")["NUM_SPLITS"] == 2


@pytest.mark.parametrize("groups, cap, expected", [
    (16, 17, 16),   # 272 programs would put three on 8 of 132 SMs: 256 put at most two on each
    (128, 3, 3),    # 384 programs, as even as 256, and more splits on a tie
    (2, 128, 128),  # 66 splits (one program per SM) fall under the fewest programs allowed
    (2, 64, 64),    # the cap allows fewer programs than the SMs: take it
    (24, 11, 11),   # 264 programs: two per SM exactly
])
def test_split_count_spreads_programs_evenly(groups, cap, expected):
    assert flexattn.kernels.decode.balanced_splits(groups, cap, 132) == expected


def test_split_count_is_never_less_even_than_the_cap():
    sms = 132
    def busiest_share(s, groups):  # programs over the slots of the busiest SM's count
        return groups * s / (sms * -(-groups * s // sms))
    for groups in range(1, 300, 7):
        for cap in range(1, 140, 5):
            s = flexattn.kernels.decode.balanced_splits(groups, cap, sms)
            assert 1 <= s <= cap
            if groups * cap >= flexattn.kernels.decode.MIN_FILL * flexattn.kernels.decode.WAVES * sms:
                assert busiest_share(s, groups) >= busiest_share(cap, groups)
                assert groups * s >= flexattn.kernels.decode.MIN_FILL * flexattn.kernels.decode.WAVES * sms
            else:
                assert s == cap


def test_per_batch_masks_and_valid_lengths():
    # Each sequence of the batch has its own valid cache length and its own mask (a BlockMask with a
    # batch dimension); the score_mod reads the batch index too.
    B, Hq, Hkv, L, S = 3, 4, 2, 2, 333
    lengths = torch.tensor([333, 130, 7], device=DEVICE)
    bias = torch.randn(B, device=DEVICE)

    def valid(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (kv_idx <= q_idx + lengths[b] - L)

    def per_batch_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b] * (kv_idx - q_idx) / 64

    q, k, v = qkv(B, Hq, Hkv, L, S)
    block_mask = create_block_mask(valid, B, None, L, S, device=DEVICE, BLOCK_SIZE=64)
    assert block_mask.kv_num_blocks.shape[0] == B
    check_decode(q, k, v, per_batch_bias, valid, block_mask=block_mask, splits=3)


def test_fully_masked_rows():
    # Query 0 of every head keeps nothing: output 0 and LSE -inf, as the forward gives.
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx > 0) & (kv_idx < 100 + h)

    q, k, v = qkv(2, 4, 2, 3, 260)
    check_decode(q, k, v, None, mask_mod, mask_batch=2, splits=3)
    out, aux = flex_attention(q, k, v, block_mask=create_block_mask(mask_mod, None, None, 3, 260, device=DEVICE),
                              enable_gqa=True, kernel_options={"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 3},
                              return_aux=AuxRequest(lse=True))
    assert (out[:, :, 0] == 0).all() and (aux.lse[:, :, 0] == float("-inf")).all()


def test_per_head_tables():
    # create_block_mask(..., H=Hq) gives every head its own tables. Heads of a group with equal tables
    # still share one program; a head-dependent mask runs one head per program.
    B, Hq, Hkv, L, S = 2, 6, 2, 1, 300
    q, k, v = qkv(B, Hq, Hkv, L, S)
    plan = check_decode(q, k, v, None, shifted(None, causal_mask, S - 1)[1], mask_heads=Hq, block_size=64, splits=2)
    assert plan.constexprs("partial")["HEADS"] == 3

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx + S - 1 - kv_idx) < 40 + 50 * h

    plan = check_decode(q, k, v, None, per_head_window, mask_heads=Hq, block_size=64, splits=2)
    assert plan.constexprs("partial")["HEADS"] == 1 and plan.steps["partial"].grid[1] == Hq


def test_tables_changed_in_place_are_seen():
    # The group check lives on the mask, stamped with its tables: changing one head's row in place
    # must split the group again, and the result must follow the tables (the forward kernel's answer).
    B, Hq, Hkv, L, S = 1, 4, 1, 1, 256
    q, k, v = qkv(B, Hq, Hkv, L, S)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, B, Hq, L, S, device=DEVICE, BLOCK_SIZE=64)
    options = {"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 2}
    with expect_decode():
        before = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)
    assert _last_plan().constexprs("partial")["HEADS"] == 4
    block_mask.full_kv_num_blocks[0, 2, 0] = 2  # head 2 now sees only its first two key blocks
    with expect_decode():
        after = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)
    assert _last_plan().constexprs("partial")["HEADS"] == 1
    forward = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options={"BACKEND": "TRITON"})
    assert rel_err(after, forward) < 2e-5 and rel_err(before[:, 2], after[:, 2]) > 1e-2
    assert torch.equal(before[:, :2], after[:, :2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="row tiles are 64 rows on a GPU, 128 under the interpreter")
def test_many_rows_are_cut_into_row_tiles():
    # 16 query heads x 16 queries on one key/value head: 256 rows, two tiles of 128 under the interpreter.
    q, k, v = qkv(1, 16, 1, 16, 150, E=16)
    score_mod, mask_mod = shifted(generate_alibi_bias(16, DEVICE), causal_mask, 134)
    plan = check_decode(q, k, v, score_mod, mask_mod, block_size=64, splits=2)
    assert plan.constexprs("partial")["ROW_TILES"] == 2


def test_broadcast_kv_batch_and_negative_scale():
    q, k, v = qkv(3, 4, 2, 2, 190, kv_batch=1)
    check_decode(q, k, v, None, shifted(None, causal_mask, 188)[1], splits=2, scale=-0.2)


def test_dense_without_block_mask():
    q, k, v = qkv(2, 8, 2, 4, 129, E=64)
    check_decode(q, k, v, None, None, splits=2)


# ------------------------------------------------------------------------------------ dispatch


def test_dispatch_rule():
    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    long_q = torch.randn(1, 2, 65, 16, device=DEVICE)
    mask = create_block_mask(causal_mask, None, None, 16, 64, device=DEVICE, BLOCK_SIZE=16)
    long_mask = create_block_mask(causal_mask, None, None, 65, 64, device=DEVICE)
    assert _dispatch_decode("TRITON", {}, q, mask, False, False) == "TRITON_DECODE"
    assert _dispatch_decode("TRITON", {}, long_q, long_mask, False, False) == "TRITON"  # q_len 65 > 64
    q64 = torch.randn(1, 2, 64, 16, device=DEVICE)
    mask64 = create_block_mask(causal_mask, None, None, 64, 64, device=DEVICE)
    assert _dispatch_decode("TRITON", {}, q64, mask64, False, False) == "TRITON_DECODE"
    assert _dispatch_decode("TRITON", {}, q, mask, True, False) == "TRITON"  # gradients: the forward
    assert _dispatch_decode("TRITON", {}, q, mask, False, True) == "TRITON"  # max_scores: the forward
    assert _dispatch_decode("TRITON", {"FORCE_USE_FLEX_ATTENTION": True}, q, mask, False, False) == "TRITON"
    assert _dispatch_decode("TRITON", {"BACKEND": "TRITON"}, q, mask, False, False) == "TRITON"
    assert _dispatch_decode("TRITON_DECODE", {"BACKEND": "TRITON_DECODE"}, q, mask, True, False) == "TRITON"
    # Queries that straddle two query blocks of the mask stay on the forward kernel.
    q8 = torch.randn(1, 2, 8, 16, device=DEVICE)
    assert _dispatch_decode("TRITON", {}, q8, create_block_mask(causal_mask, None, None, 8, 64, device=DEVICE,
                                                                BLOCK_SIZE=(16, 64)), False, False) == "TRITON_DECODE"


def test_forced_decode_with_gradients_or_max_scores_runs_the_forward():
    q, k, v = qkv(1, 2, 2, 2, 100)
    options = {"BACKEND": "TRITON_DECODE"}
    with expect_decode(runs=False):
        out, aux = flex_attention(q, k, v, kernel_options=options, return_aux=AuxRequest(lse=True, max_scores=True))
    ref_out, ref_lse, ref_max = reference_attention(q.double(), k.double(), v.double())
    assert rel_err(out, ref_out) < 2e-5 and rel_err(aux.max_scores, ref_max) < 2e-5
    q.requires_grad_(True)
    with expect_decode(runs=False):
        out = flex_attention(q, k, v, kernel_options=options)
    assert out.requires_grad


def test_forced_decode_errors():
    q, k, v = qkv(1, 2, 2, 20, 64)
    mask = create_block_mask(causal_mask, None, None, 20, 64, device=DEVICE, BLOCK_SIZE=16)
    with pytest.raises(InvalidInputError, match="query block size 16"):
        flex_attention(q, k, v, block_mask=mask, kernel_options={"BACKEND": "TRITON_DECODE"})
    with pytest.raises(InvalidInputError, match="FORCE_USE_FLEX_ATTENTION"):
        flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON_DECODE", "FORCE_USE_FLEX_ATTENTION": True})
    with pytest.raises(InvalidInputError, match="DECODE_NUM_SPLITS"):
        flex_attention(q[:, :, :1], k, v, kernel_options={"BACKEND": "TRITON_DECODE", "DECODE_NUM_SPLITS": 0})


def test_auto_on_cpu_stays_on_the_pytorch_backend():
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch")
    q, k, v = qkv(1, 2, 2, 1, 64)
    with expect_decode(runs=False):
        flex_attention(q, k, v)
