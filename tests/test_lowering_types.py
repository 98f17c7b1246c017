"""Typed lowering: dtypes as torch decides them, exact index arithmetic, and the bounds analysis.

Golden sources pin what the kernel computes in (bool logic, int32 or int64, where a cast starts a
new value); the numerical tests run the same mods in Triton's interpreter against the mod itself
(evaluated by torch with int64 indices where the mod needs them, i.e. with Python-integer meaning).
"""

import pytest
import torch

from flexattn.lowering import IndexBounds, LoweringVariant, lower, lowering_variant, needs_wide_indices
from flexattn.lowering.ranges import CONSERVATIVE_BOUNDS, GatherCheck, analyze
from flexattn.trace import trace_mod
from flexattn.variants import CATALOGUE, causal_mask, document_ids, generate_alibi_bias
from test_lowering import DOC, check, lowered_of, run_kernel, tile_bounds

pytestmark = pytest.mark.usefixtures("one_thread")

L128K = 131072


def linear_index_mask(b, h, q_idx, kv_idx):
    # Issue 8, item 3: a linearised (query, key) index, which leaves int32 at 128k tokens. The row
    # length is written in the code: a literal, whose value the lowering knows.
    return ((q_idx * 131072 + kv_idx) % 3 == 0) | (q_idx == kv_idx)


def linear_index_by_number(b, h, q_idx, kv_idx):
    # The same with the row length read from a global: a number the kernels take at run time,
    # with any value up to NUMBER_INT_LIMIT, so the product is int64 at every length.
    return ((q_idx * L128K + kv_idx) % 3 == 0) | (q_idx == kv_idx)


def small_overflow_mask(b, h, q_idx, kv_idx):
    # The same overflow at lengths the interpreter can run: q_idx * 2**28 leaves int32 from q_idx = 8.
    return ((q_idx * 2**28 + kv_idx) % 3 == 0) | (q_idx == kv_idx)


def traced(fn, kind="mask_mod"):
    return trace_mod(fn, kind)[0]


# -- bools ------------------------------------------------------------------------------------------


def test_bool_add_is_or_and_bool_mul_is_and():
    lowered = lowered_of(lambda s, b, h, q, kv: ((q >= kv) + (kv >= 0)) * 1.0 + ((q >= kv) * (kv > 3)) * 2.0)
    assert lowered.lines == ("sm_t0 = q_idx >= kv_idx",)
    assert lowered.result == "(sm_t0 | (kv_idx >= 0)).to(tl.float32) * 1.0 + (sm_t0 & (kv_idx > 3)).to(tl.float32) * 2.0"


@pytest.mark.parametrize(
    "fn",
    [
        lambda s, b, h, q, kv: s + ((q >= kv) + (kv >= 0)) * 1.0,  # issue 8 item 6: 2.0 before, torch 1.0
        lambda s, b, h, q, kv: s + ((q >= kv) * (kv >= 3)) * 1.5 + torch.maximum(q > 3, kv > 9) * 2.0,
        lambda s, b, h, q, kv: s + torch.minimum(q > 3, kv > 9) + (q > 5) * 1 + (q > kv) * (kv > 2) * 0.5,
    ],
    ids=["add", "mul_maximum", "minimum_int"],
)
def test_bool_arithmetic_matches_torch(fn):
    check(fn, kv_start=3)
    check(fn, q_start=7, kv_start=0)


# -- casts start a new value --------------------------------------------------------------------


def test_widening_cast_comes_before_the_arithmetic():
    # issue 8 item 7: was `(100000 * kv_idx * q_idx).to(tl.int64)`, a product formed in int32
    lowered = lowered_of(lambda b, h, q, kv: q.to(torch.int64) * kv * 100000 % 7 == 0, "mask_mod")
    assert lowered.result == "py_remainder(100000 * kv_idx.to(tl.int64) * q_idx, 7) == 0"


def test_a_loaded_int32_product_wraps_before_it_is_widened():
    # torch computes doc * 100000 in int32 (it may wrap) and only then widens: so does the kernel
    lowered = lowered_of(lambda b, h, q, kv: (DOC[q] * 100000).to(torch.int64) * kv > 5, "mask_mod")
    assert lowered.result == "(100000 * tl.load(mm_DOC_ptr + q_idx * mm_DOC_stride0)).to(tl.int64) * kv_idx > 5".replace(
        "mm_", "sm_"
    )


def test_narrowing_cast_wraps_as_torch():
    lowered = lowered_of(lambda b, h, q, kv: (q * 1000).to(torch.int16) + 1 > kv, "mask_mod")
    assert lowered.result == "((1000 * q_idx).to(tl.int16) + 1).to(tl.int32) > kv_idx"


@pytest.mark.parametrize(
    "fn",
    [
        lambda s, b, h, q, kv: s + ((q.to(torch.int64) * kv * 10**7) % 1000003).float(),  # > 2**31 at q * kv > 214
        lambda s, b, h, q, kv: s + (q * 1000).to(torch.int16) + (q * 5000 + kv).to(torch.int8) / 10,
        lambda s, b, h, q, kv: s + (q.long() - kv).int() + (DOC[q] * 2**30 + kv).long() % 11,
    ],
    ids=["int64_product", "narrowing", "loaded_wraps"],
)
def test_casts_match_torch(fn):
    check(fn, kv_start=3)
    check(fn, q_start=12, kv_start=0)


# -- exact index arithmetic -------------------------------------------------------------------------


def test_int64_constant_is_a_typed_constant():
    # issue 8 item 7: `q_idx + 2**33` crashed the interpreter ("Scalar 8589934592 is out of range")
    lowered = lowered_of(lambda b, h, q, kv: (q < 2**33) & ((q + 2**33) % 5 == kv), "mask_mod")
    assert lowered.result == (
        "(q_idx.to(tl.int64) < tl.full([], 8589934592, tl.int64)) & "
        "(py_remainder(q_idx.to(tl.int64) + 8589934592, 5) == kv_idx.to(tl.int64))"
    )


def test_int64_constants_match_python_integers():
    fn = lambda s, b, h, q, kv: s + ((q + 2**33) % 7) + (kv < 2**33) + (q * 2**33 > 2**34) + torch.full((), 2**40) / 2**40  # noqa: E731
    check(fn, kv_start=3)


def test_linearised_index_is_int64_at_128k_and_int32_below():
    t = traced(linear_index_mask)
    wide = lower(t, variant=lowering_variant(t, IndexBounds(1, 1, L128K, L128K)))
    assert wide.result == "(py_remainder(131072 * q_idx.to(tl.int64) + kv_idx, 3) == 0) | (q_idx == kv_idx)"
    narrow = lower(t, variant=lowering_variant(t, IndexBounds(1, 1, 4096, 4096)))
    assert narrow.result == "(py_remainder(kv_idx + 131072 * q_idx, 3) == 0) | (q_idx == kv_idx)"
    assert needs_wide_indices(t, IndexBounds(1, 1, L128K, L128K))
    assert not needs_wide_indices(t, IndexBounds(1, 1, 4096, 4096))
    # 16384 * 131072 = 2**31: the last length at which every value still fits is 16384
    assert not needs_wide_indices(t, IndexBounds(1, 1, 16384, 16384))
    assert needs_wide_indices(t, IndexBounds(1, 1, 16385, 16384))


def test_index_times_a_number_is_int64_at_any_length():
    # trace/numbers.py: the row length read from a global is a kernel argument whose value the
    # lowering does not know (any int up to NUMBER_INT_LIMIT = 2**24), so the product is exact:
    # int64 from the length where 2**24 rows could leave int32 on, whatever the value; one kernel
    # serves every row length.
    t = traced(linear_index_by_number)
    assert [n.name for n in t.numbers] == ["L128K"]
    narrow = lower(t, variant=lowering_variant(t, IndexBounds(1, 1, 64, 64)))
    assert narrow.result == "(py_remainder(kv_idx + q_idx * sm_L128K, 3) == 0) | (q_idx == kv_idx)"
    for length in (4096, L128K):
        lowered = lower(t, variant=lowering_variant(t, IndexBounds(1, 1, length, length)))
        assert lowered.result == "(py_remainder(q_idx.to(tl.int64) * sm_L128K + kv_idx, 3) == 0) | (q_idx == kv_idx)"
    check(linear_index_by_number, "mask_mod", kv_start=3)


def test_overflowing_index_arithmetic_is_exact():
    # The 128k case at interpreter sizes: q_idx * 2**28 leaves int32 from q_idx = 8 on.
    t = traced(small_overflow_mask)
    assert needs_wide_indices(t, tile_bounds(0, 0, 0, 0, 16, 16))
    assert not needs_wide_indices(t, tile_bounds(0, 0, 0, 0, 8, 16))
    check(small_overflow_mask, "mask_mod", b=0, h=0, q_start=0, kv_start=0)
    check(small_overflow_mask, "mask_mod", b=0, h=0, q_start=16, kv_start=5)


def test_overflow_is_not_hidden_by_a_wrapping_reference():
    # The kernel agrees with Python integers, not with torch's int32 arithmetic (which wraps here).
    score = torch.zeros(16, 16)
    got = run_kernel(small_overflow_mask, "mask_mod", score, b=0, h=0, q_start=0, kv_start=0,
                     bounds=tile_bounds(0, 0, 0, 0, 16, 16))  # fmt: skip
    want = torch.tensor([[((q * 2**28 + kv) % 3 == 0) or q == kv for kv in range(16)] for q in range(16)])
    assert torch.equal(got, want)


def test_shifts_are_exact_where_torch_int32_would_lose_bits():
    fn = lambda b, h, q, kv: ((q >> 2) << 3) + ((kv << 40) >> 38) > 2 * q  # noqa: E731
    lowered = lowered_of(fn, "mask_mod")
    assert lowered.result == (
        "(q_idx >> 2 << 3).to(tl.int64) + (kv_idx.to(tl.int64) << 40 >> 38) > (2 * q_idx).to(tl.int64)"
    )
    check(fn, "mask_mod", kv_start=3)


# -- the bounds analysis --------------------------------------------------------------------------


def test_catalogue_mods_stay_int32_and_unchecked_at_their_lengths():
    # The paper's variants (the benchmark's); entries that index a table with a value read from
    # another (packed_documents, t5_bias, graphormer) rightly keep their gather checks.
    for name, variant in ((n, v) for n, v in CATALOGUE.items() if v.paper):
        for length in (1024, 65536, L128K):
            score_mod, mask_mod = variant.build(2, 8, length, length, "cpu")
            for fn, kind in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
                if fn is not None:
                    v = lowering_variant(traced(fn, kind), IndexBounds(2, 8, length, length))
                    assert v == LoweringVariant(), (name, length, v)


def test_variant_is_the_same_for_every_length_with_the_same_decisions():
    t = traced(causal_mask)
    variants = {lowering_variant(t, IndexBounds(b, h, n, n)) for b, h, n in [(1, 1, 1), (4, 32, 4096), (2**31, 2**31, 2**31)]}
    assert variants == {LoweringVariant()}
    hash(lowering_variant(traced(linear_index_mask), IndexBounds(1, 1, L128K, L128K)))


def test_gather_checks_follow_the_index_ranges():
    rel = torch.randn(63)
    doc = document_ids([10, 22], "cpu")  # 32 tokens
    slopes = torch.randn(8)
    cases = [
        # (mod, bounds, expected check of index 0)
        (lambda s, b, h, q, kv: s + rel[q - kv + 31], IndexBounds(1, 1, 32, 32), GatherCheck()),
        (lambda s, b, h, q, kv: s + rel[q - kv + 31], IndexBounds(1, 1, 33, 32), GatherCheck(high=True)),
        (lambda s, b, h, q, kv: s + rel[q - kv], IndexBounds(1, 1, 32, 32), GatherCheck(wrap=True)),
        (lambda s, b, h, q, kv: s + rel[q - kv], IndexBounds(1, 1, 32, 64), GatherCheck(wrap=True)),
        (lambda s, b, h, q, kv: s + rel[q - kv], IndexBounds(1, 1, 32, 65), GatherCheck(wrap=True, low=True)),
        (lambda s, b, h, q, kv: s + doc[q] * 1.0, IndexBounds(1, 1, 32, 64), GatherCheck()),
        (lambda s, b, h, q, kv: s + doc[q] * 1.0, IndexBounds(1, 1, 33, 32), GatherCheck(high=True)),
        (lambda s, b, h, q, kv: s + slopes[h], IndexBounds(1, 8, 32, 32), GatherCheck()),
        (lambda s, b, h, q, kv: s + slopes[h], IndexBounds(1, 9, 32, 32), GatherCheck(high=True)),
        (lambda s, b, h, q, kv: s + slopes[(h - 3).clamp(0, 7)], IndexBounds(1, 99, 32, 32), GatherCheck()),
        (lambda s, b, h, q, kv: s + slopes[doc[q]], IndexBounds(1, 1, 32, 32), GatherCheck(wrap=True, low=True, high=True)),
    ]
    for fn, bounds, expected in cases:
        t = traced(fn, "score_mod")
        variant = lowering_variant(t, bounds)
        gathers = [node for node in t.graph.nodes if node.target is torch.ops.aten.index.Tensor]
        assert variant.gather_check(gathers[-1].name, 0) == expected, (bounds, variant)


def test_unknown_lengths_are_conservative():
    # lower() without a variant must be right for any lengths: the sum of two indices may leave
    # int32, and no gather is provably in range.
    lowered = lowered_of(lambda b, h, q, kv: q + kv > 7, "mask_mod", bounds=None)
    assert lowered.result == "kv_idx.to(tl.int64) + q_idx > 7"
    lowered = lowered_of(generate_alibi_bias(4), bounds=None)
    assert lowered.lines == ("sm_t0 = (off_hq < 4)", "sm_t1 = tl.where(sm_t0, off_hq, 0)")
    assert lowered.result == (
        "qk + tl.where(sm_t0, tl.load(sm_slopes_ptr + sm_t1 * sm_slopes_stride0), 0) * (kv_idx - q_idx).to(tl.float32)"
    )
    assert lowering_variant(traced(causal_mask), CONSERVATIVE_BOUNDS) == LoweringVariant()


def test_ranges_of_common_index_expressions():
    def mod(b, h, q_idx, kv_idx):
        window = (q_idx - kv_idx).abs() // 16
        tile = (kv_idx % 64) * 2 + torch.where(q_idx > 5, -3, 7)
        bits = (q_idx & 0xFF) | (kv_idx >> 4)
        return (window < tile) & (bits > (q_idx.clamp(3, 9) - 1)) & (-q_idx < torch.maximum(h, b) ** 2)

    t = traced(mod)
    facts = {n.name: f for n, f in analyze(t, IndexBounds(3, 5, 100, 200)).facts.items() if f is not None}
    ranges = {name: (f.lo, f.hi) for name, f in facts.items()}
    assert ranges["abs_default"] == (0, 199)
    assert ranges["floor_divide_default"] == (0, 12)
    assert ranges["remainder_scalar"] == (0, 63)
    assert ranges["add_tensor"] == (-3, 133)
    assert ranges["bitwise_and_scalar"] == (0, 99)
    assert ranges["__rshift___scalar"] == (0, 12)
    assert ranges["clamp_default"] == (3, 9)
    assert ranges["pow_tensor_scalar"] == (0, 16)
    assert facts["add_tensor"].dtype == torch.int64  # torch.where(c, -3, 7) is int64, as in torch
    assert all(f.exact for f in facts.values()) and not analyze(t, IndexBounds(3, 5, 100, 200)).wide


def test_loaded_values_have_no_range_and_stay_in_torch_dtypes():
    # doc[q] * 2**30 wraps in torch (int32): not widened, and not exact
    t = traced(lambda b, h, q, kv: DOC[q] * 2**30 + kv > 0)
    facts = {n.name: f for n, f in analyze(t, IndexBounds(1, 1, 32, 32)).facts.items() if f is not None}
    assert facts["mul_tensor"].dtype == torch.int32 and not facts["mul_tensor"].exact
    assert lowering_variant(t, IndexBounds(1, 1, 32, 32)) == LoweringVariant()


def test_index_bounds_are_checked():
    with pytest.raises(ValueError, match="Q_LEN"):
        IndexBounds(1, 1, -1, 4)
    with pytest.raises(ValueError, match="KV_LEN"):
        IndexBounds(1, 1, 4, 2**40)
    with pytest.raises(TypeError, match="lowering_variant"):
        lower(traced(causal_mask), variant=IndexBounds(1, 1, 4, 4))
    # a variant is about one graph and its captured shapes: another mod's would leave gathers unguarded
    def bias_of(rel):
        return lambda s, b, h, q, kv: s + rel[q]

    long, short = (traced(bias_of(torch.randn(n)), "score_mod") for n in (64, 32))  # same code, other shapes
    assert long.graph_module.code == short.graph_module.code
    with pytest.raises(ValueError, match="another mod"):
        lower(short, variant=lowering_variant(long, IndexBounds(1, 1, 64, 64)))


# -- gathers at indices torch wraps or refuses ------------------------------------------------------

REL = torch.randn(40, generator=torch.Generator().manual_seed(3))


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + REL[q_idx - kv_idx]  # negative when kv_idx > q_idx: torch reads REL[40 + i]


def test_negative_gather_index_wraps_as_torch():
    # issue 8 item 5: read before the tensor's start (relative error 0.78) before the fix
    t = traced(relative_bias, "score_mod")
    lowered = lower(t, variant=lowering_variant(t, IndexBounds(1, 1, 32, 32)))
    assert lowered.lines == ("sm_t0 = q_idx - kv_idx",)
    assert lowered.result == "qk + tl.load(sm_REL_ptr + tl.where(sm_t0 < 0, sm_t0 + 40, sm_t0) * sm_REL_stride0)"
    check(relative_bias, kv_start=3)
    check(relative_bias, q_start=20, kv_start=0)


def test_out_of_range_gather_reads_zero():
    # torch refuses REL[q + kv] past 40; the kernel reads 0 there, never memory after the tensor
    def far(score, b, h, q_idx, kv_idx):
        return score + REL[q_idx + kv_idx - 20]

    score = torch.randn(16, 16)
    got = run_kernel(far, "score_mod", score, b=0, h=0, q_start=10, kv_start=20, bounds=tile_bounds(0, 0, 10, 20, 16, 16))
    index = torch.arange(10, 26)[:, None] + torch.arange(20, 36)[None, :] - 20
    want = score + torch.where(index < 40, REL[index.clamp(max=39)], 0.0)
    torch.testing.assert_close(got, want)
    got_any = run_kernel(far, "score_mod", score, b=0, h=0, q_start=10, kv_start=20, bounds=None)
    torch.testing.assert_close(got_any, want)


# -- a seeded differential check of integer index arithmetic ------------------------------------------

_FUZZ_REL = torch.randn(50, generator=torch.Generator().manual_seed(1))
_FUZZ_DOC = torch.randint(-3, 40, (300,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)


def _random_int_expr(rng, depth: int) -> str:
    """Index arithmetic with negative intermediates, // and %, shifts, casts, loaded values, gathers at
    derived (negative) indices and constants beyond int32."""
    t = "torch.as_tensor"
    if depth == 0 or rng.random() < 0.25:
        return rng.choice(["q", "kv", "h", "b", "DOC[q]", "DOC[kv] * kv", "(q * 2**28)",
                           str(rng.choice([1, 3, 7, 64, 1000, 2**20, -5, 2**33]))])  # fmt: skip
    a, b = _random_int_expr(rng, depth - 1), _random_int_expr(rng, depth - 1)
    op = rng.choice(["+", "-", "*", "//", "%", "&", "^", "abs", "max", "shift", "tshift", "where", "cast", "gather"])
    if op in ("+", "-", "*"):
        return f"({a} {op} {b})"
    if op in ("&", "^"):
        return f"({t}({a}) {op} {t}({b}))"
    if op in ("//", "%"):
        return f"({t}({a}) {op} {rng.choice([3, -4, 64, 2**31 + 5])})"
    if op == "abs":
        return f"torch.abs({t}({a}))"
    if op == "max":
        return f"torch.maximum({t}({a}), {t}({b}))"
    if op == "shift":
        return f"({t}({a}) {rng.choice(['<<', '>>'])} {rng.choice([1, 8, 31, 40])})"
    if op == "tshift":
        return f"({t}({a}) {rng.choice(['<<', '>>'])} ({t}({b}) % 37).abs())"
    if op == "where":
        return f"torch.where(q > kv, {a}, {b})"
    if op == "cast":
        return f"{t}({a}).to({rng.choice(['torch.int64', 'torch.int16'])})"
    return f"(REL[{t}({a}).to(torch.int64) % 50 - 25] * 4).to(torch.int32)"  # wraps negatives


@pytest.mark.parametrize("seed", range(40))
def test_random_index_arithmetic_matches_torch(seed):
    import random

    from flexattn.errors import UnsupportedOpError

    rng = random.Random(seed)
    source = _random_int_expr(rng, 4)
    namespace = {"torch": torch, "REL": _FUZZ_REL, "DOC": _FUZZ_DOC}
    fn = eval(f"lambda s, b, h, q, kv: s + (torch.as_tensor({source}) % 1009) * 1.0", namespace)
    where = dict(b=0, h=1, q_start=rng.choice([0, 5, 100]), kv_start=rng.choice([0, 3, 50]))
    try:
        check(fn, **where, rtol=0, atol=0)
    except ZeroDivisionError:
        pytest.skip(f"torch divides by zero in {source}")
    except RuntimeError as err:  # torch refusing the expression (an overflowing constant) is no finding
        if isinstance(err, UnsupportedOpError) or "nterpreter" in type(err).__name__:
            raise
        pytest.skip(f"torch refuses {source}: {str(err)[:60]}")
    except AssertionError as err:
        raise AssertionError(f"{source}\n{err}") from None

