"""The ops torch's and attention-gym's mods emit, every attention-gym mod, and where errors point.

Numerical checks run the lowered mod in Triton's interpreter on one tile against the mod itself
(tests/test_lowering.py's ``check``), lowered both for any lengths and for the tile's own lengths.
The attention-gym list also runs end to end through ``flex_attention(..., BACKEND="TRITON")``
against the float64 reference.
"""

import inspect

import pytest
import torch

import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import flexattn.trace as trace
from flexattn import create_block_mask, flex_attention
from flexattn.errors import UnsupportedOpError
from flexattn.lowering import LOWERINGS, IndexBounds, lower, lowering_variant
from flexattn.reference import reference_attention
from flexattn.trace import trace_mod
from flexattn.variants import causal_mask
from numerics import rel_err
from test_lowering import INTERPRETED, check, lowered_of

pytestmark = pytest.mark.usefixtures("one_thread")

_gen = torch.Generator().manual_seed(7)
QE = torch.randn(64, 8, generator=_gen)  # per-token embeddings: torch.dot(QE[q], KE[kv])
KE = torch.randn(64, 8, generator=_gen)
BIG = torch.randn(64, 256, generator=_gen)  # rows too long to unroll
TABLE = torch.randn(24, 40, generator=_gen)
TABLE3 = torch.randn(40, 24, 4, generator=_gen)
TOPK = torch.randint(0, 8, (4, 8, 3), generator=_gen, dtype=torch.int32)  # [H, query tiles, top-k]
FLAGS = torch.rand(64, 6, generator=_gen) > 0.5
EDGES = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 2.0**23 + 1, 1e-8, -0.0, 0.0,
                      float("nan"), float("inf"), float("-inf"), 3.7])  # fmt: skip


def prefix_16(b, h, q_idx, kv_idx):
    return kv_idx < 16


SCORE_MODS = {
    # constants torch's own combinators start from, and factories called inside a mod
    "new_full_and_friends": lambda s, b, h, q, kv: (
        s + b.new_full((), 2.5) + torch.full((), 3) + torch.scalar_tensor(1.5) + h.new_zeros(()) * 4
        + q.new_ones((), dtype=torch.float32) + torch.arange(3)[1] + torch.zeros(4).sum()
    ),  # fmt: skip
    # >> and << (Morton codes), with constant and tensor amounts (torch: 0 past the width)
    "shifts": lambda s, b, h, q, kv: (
        s + (((q << 3) | (kv >> 1)) ^ (q >> 2)) + (q >> (kv % 5)) + (kv << (q % 40)) % 1000
        + torch.bitwise_right_shift(-kv, 2) + torch.bitwise_left_shift(q, 1)
    ),  # fmt: skip
    # views of one value change nothing
    "views_of_values": lambda s, b, h, q, kv: (
        s + q.unsqueeze(0).view(()).reshape(1).squeeze() + kv.expand(()) * s.view(1, 1).squeeze(0)[0]
    ),  # fmt: skip
    "gelu_erf": lambda s, b, h, q, kv: F.gelu(s) + F.gelu(s, approximate="tanh") * 2 + torch.erf(s / 3),
    "log1p_expm1": lambda s, b, h, q, kv: (
        torch.log1p(s.abs()) + torch.log1p(s * 1e-6) * 1e6 + torch.expm1(s / 2) + torch.expm1(s * 1e-5) * 1e5
    ),  # fmt: skip
    "sign_round_trunc": lambda s, b, h, q, kv: (
        torch.sign(s) + torch.round(s * 2) + torch.round(s, decimals=1) * 3 + torch.round(s * 40, decimals=-1)
        + torch.trunc(s * 3) + torch.sign(q - kv) * 5 + torch.round(q - kv) + torch.trunc(kv)
    ),  # fmt: skip
    "relu_softplus_silu_hardtanh": lambda s, b, h, q, kv: (
        F.relu(s) + F.relu(q - kv) + F.softplus(s) + F.softplus(s * 10, beta=2, threshold=5) + F.silu(s)
        + F.hardtanh(s, -0.5, 1.5)
    ),  # fmt: skip
    # small vectors read from captured tables, unrolled
    "dot": lambda s, b, h, q, kv: s + torch.dot(QE[q], KE[kv]) * 0.5,
    "mul_sum_and_reductions": lambda s, b, h, q, kv: (
        s + (QE[q] * KE[kv]).sum() + QE[q].mean() + KE[kv].amax() - QE[kv].amin() + (QE[q][:3] + 2).prod()
        + FLAGS[q].any() + FLAGS[kv].all() + QE[q].sum(0) + torch.max(KE[q]) + torch.vdot(QE[kv], KE[q])
    ),  # fmt: skip
    # slices, transposes and selects of captured tensors fold into the offset and strides
    "slices_and_transposes": lambda s, b, h, q, kv: (
        s + TABLE[:, 1:][h, kv] + TABLE.T[kv, q] + TABLE.t()[q][kv] + TABLE.permute(1, 0)[q + 1, h]
        + TABLE[1:-1:2, ::3][h, kv % 13] + TABLE.select(1, 2)[q] + TABLE3.transpose(0, 2)[h, q, kv]
        + TABLE[q].unsqueeze(0)[0, kv] + TABLE[-3:][1, kv]
    ),  # fmt: skip
}

MASK_MODS = {
    # torch's combinators: `result = b.new_zeros((), dtype=torch.bool)`, then `result | mod(...)`
    "torch_or_and_noop": torch_flex.and_masks(torch_flex.or_masks(prefix_16, causal_mask), torch_flex.noop_mask),
    # attention-gym's VSA: a row of selected tiles compared with this key's tile, then any()
    "row_contains": lambda b, h, q, kv: (TOPK[h, q // 4] == (kv // 4).unsqueeze(-1)).any(dim=-1),
    "morton_like": lambda b, h, q, kv: ((q & 0x55555555) | ((q >> 1) & 0x33333333)) >= ((kv << 1) & 0xFF),
}


# Some of these mods pass through inf or NaN on purpose (log1p at -1, softplus's exp past its
# threshold, a division in torch.where's untaken branch). Triton's interpreter computes with NumPy,
# which warns there; a GPU computes the same IEEE values silently, and the results are compared.
@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero|overflow) encountered in:RuntimeWarning")
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_new_score_mod_ops_match_torch(name):
    loose = dict(rtol=2e-5, atol=2e-5) if name in ("gelu_erf", "log1p_expm1", "relu_softplus_silu_hardtanh") else {}
    check(SCORE_MODS[name], "score_mod", h=2, kv_start=3, **loose)
    check(SCORE_MODS[name], "score_mod", b=0, h=3, q_start=7, kv_start=0, **loose)


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_new_mask_mod_ops_match_torch(name):
    check(MASK_MODS[name], "mask_mod", kv_start=3)
    check(MASK_MODS[name], "mask_mod", h=3, q_start=16, kv_start=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf and NaN
def test_round_is_half_to_even_and_sign_follows_torch_on_edge_values():
    # floor(x + 0.5), which the old error message suggested, is wrong on 2.5, -0.5 and 0.49999997
    score = EDGES.repeat(16, 1)
    check(lambda s, b, h, q, kv: torch.round(s) + torch.sign(s) + torch.trunc(s), score=score)
    check(lambda s, b, h, q, kv: torch.log1p(s) + torch.expm1(s.clamp(max=80)), score=score.abs() * 3, rtol=2e-6, atol=1e-7)


def test_dot_source_is_unrolled_over_sliced_rows():
    lowered = lowered_of(lambda s, b, h, q, kv: s + torch.dot(QE[q][:2], KE[kv][1::4][:2]))
    assert lowered.result == (
        "qk + (tl.load(sm_QE_ptr + q_idx * sm_QE_stride0) * tl.load(sm_KE_ptr + (kv_idx * sm_KE_stride0 + sm_KE_stride1))"
        " + tl.load(sm_QE_ptr + (q_idx * sm_QE_stride0 + sm_QE_stride1))"
        " * tl.load(sm_KE_ptr + (kv_idx * sm_KE_stride0 + 5 * sm_KE_stride1)))"
    )


def test_vectors_above_the_limit_are_refused_clearly():
    with pytest.raises(UnsupportedOpError, match=r"(?s)dimensions of size \(256,\) not indexed.*up to 128 elements"):
        lowered_of(lambda s, b, h, q, kv: s + torch.dot(BIG[q], BIG[kv]))


def test_approx_tanh_of_attention_gym_lowers_as_tanh():
    pytest.importorskip("attn_gym")
    from attn_gym.mods import generate_tanh_softcap

    softcap = generate_tanh_softcap(20, approx=True)  # an int cap, a number of the graph: converted once per use
    assert lowered_of(softcap).result == ("precise_tanh(qk * tl.math.div_rn(1.0, sm_soft_cap.to(tl.float32))) * "
                                          "sm_soft_cap.to(tl.float32)")
    assert lowered_of(softcap, tanh_approx=True).result.startswith("tanh_approx(qk * tl.math.div_rn(1.0, sm_soft_cap")
    check(softcap, "score_mod")


# -- errors name the user's line --------------------------------------------------------------------


def needs_sinh(b, h, q_idx, kv_idx):
    return torch.sinh(q_idx - kv_idx) > 0.5  # no table entry for sinh


def test_error_inside_torchs_or_masks_names_the_library_and_the_users_mods(monkeypatch):
    # issue 8: an op missing inside torch's or_masks body was reported at lowering/emit.py:627
    monkeypatch.delitem(LOWERINGS, torch.ops.aten.new_zeros)
    # Graphs are shared between mods of one definition site (torch's or_mask here), and error
    # messages name the first mod traced for a graph: start from empty trace caches, so this
    # test's mod is that first one whatever ran before it.
    for cache in ("_CACHE", "_GRAPHS", "_FAST"):
        monkeypatch.setattr(trace.cache, cache, type(getattr(trace.cache, cache))())
    mod = torch_flex.or_masks(prefix_16, causal_mask)
    with pytest.raises(UnsupportedOpError) as info:
        lower(trace_mod(mod, "mask_mod")[0])
    message = str(info.value)
    assert "aten.new_zeros" in message
    assert "flex_attention.py:" in message and "b.new_zeros((), dtype=torch.bool)" in message
    assert "inside the library function torch.nn.attention.flex_attention.or_masks.<locals>.or_mask" in message
    assert "prefix_16 (defined at " in message and "test_lowering_ops.py" in message
    assert "causal_mask (defined at " in message
    assert "passed in at " in message and "test_lowering_ops.py" in message.split("passed in at ")[1]
    assert "flexattn" + "/lowering" not in message


def test_error_in_a_users_mod_inside_torchs_or_masks_names_the_users_line():
    with pytest.raises(UnsupportedOpError) as info:
        lowered_of(torch_flex.or_masks(causal_mask, needs_sinh), "mask_mod")
    message = str(info.value)
    assert "test_lowering_ops.py:" in message and "torch.sinh(q_idx - kv_idx) > 0.5" in message
    assert "(in needs_sinh)" in message


def test_error_inside_a_torch_function_the_mod_calls_names_both():
    def mod(score, b, h, q_idx, kv_idx):
        return F.normalize(score.view(1, 1), dim=0)[0, 0]  # torch's Python normalize calls aten norm

    with pytest.raises(UnsupportedOpError) as info:
        lowered_of(mod)
    message = str(info.value)
    assert "inside the library function torch.nn.functional.normalize" in message
    assert "called at " in message and "F.normalize(score.view(1, 1), dim=0)[0, 0]" in message


# -- every attention-gym mask and score mod ---------------------------------------------------------


def attention_gym_variants(B, H, L, S, gen):
    """name -> (kind, mod) for every mask_mod / score_mod factory of attn_gym.masks and attn_gym.mods,
    with small arguments that suit B x H x L x S (L = S, a multiple of 16)."""
    from attn_gym.masks import (
        batchify_mask_mod, build_tree_ancestor_matrix, generate_block_diffusion_mask,
        generate_dilated_sliding_window, generate_doc_mask_mod, generate_global_sliding_window,
        generate_jetspec_training_mask_mod, generate_jetspec_tree_causal_mask_mod, generate_morton_natten,
        generate_natten, generate_packed_causal_doc_mask_mod, generate_prefix_lm_mask,
        generate_shared_prefix_mask_mod, generate_sliding_window, generate_spatial_head_mask_mod,
        generate_sta_mask_mod_2d, generate_sta_mask_mod_3d, generate_temporal_head_mask_mod,
        generate_tiled_natten, generate_vision_cross_attention_mask_mod, generate_vsa_mask_mod,
    )  # fmt: skip
    from attn_gym.masks import causal_mask as ag_causal
    from attn_gym.masks.document_mask import length_to_offsets
    from attn_gym.masks.vsa import generate_vsa_padding_mask_mod
    from attn_gym.mods import (
        generate_activation_score_mod, generate_alibi_bias, generate_graphormer_edge_bias,
        generate_graphormer_spatial_bias, generate_mla_rope_score_mod, generate_sandwich_bias,
        generate_tanh_softcap, shortest_path_distances, shortest_path_edge_types,
    )  # fmt: skip

    out = {}
    offsets = length_to_offsets([S // 4, S // 2, S - S // 4 - S // 2], "cpu")
    tile = 16
    top_k = torch.stack([torch.randperm(S // tile, generator=gen)[:2] for _ in range(B * H * (L // tile))])
    tile_sizes = torch.randint(1, tile + 1, (S // tile,), generator=gen)
    adjacency = torch.rand(B, L, L, generator=gen) < 0.1
    adjacency = adjacency | adjacency.transpose(1, 2)
    path_types, path_lengths = shortest_path_edge_types(adjacency, torch.randint(0, 3, (B, L, L), generator=gen), 3)
    masks = {
        "causal": ag_causal,
        "batchify_causal": batchify_mask_mod(ag_causal, 16),
        "batchify_noop": batchify_mask_mod(torch_flex.noop_mask, 16),
        "block_diffusion": generate_block_diffusion_mask(S // 2, 8),
        "dilated_sliding_window": generate_dilated_sliding_window(16, 3),
        "doc_mask_causal": generate_doc_mask_mod(ag_causal, offsets),
        "doc_mask_noop": generate_doc_mask_mod(torch_flex.noop_mask, offsets),
        "packed_causal_doc": generate_packed_causal_doc_mask_mod(offsets),
        "vision_cross_attention": generate_vision_cross_attention_mask_mod(
            torch.tensor([[0, L // 2], [L // 4, L], [L // 2, L]], dtype=torch.int32), S // 3 + 1
        ),
        "global_sliding_window": generate_global_sliding_window(8, torch.rand(S, generator=gen) < 0.1),
        "jetspec_training": generate_jetspec_training_mask_mod(8, 8),
        "jetspec_tree_causal": generate_jetspec_tree_causal_mask_mod(
            S - L, build_tree_ancestor_matrix([-1] + [i // 2 for i in range(L - 1)], device="cpu")
        ),
        "natten": generate_natten(8, L // 8, 3, 5),
        "tiled_natten": generate_tiled_natten(8, L // 8, 3, 3, 4, 4),
        "morton_natten": generate_morton_natten(8, L // 8, 3, 3),
        "prefix_lm": generate_prefix_lm_mask(S // 4),
        "shared_prefix": generate_shared_prefix_mask_mod(offsets, torch.tensor([0, 0, 2], dtype=torch.int32)),
        "sliding_window": generate_sliding_window(16),
        "sta_2d": generate_sta_mask_mod_2d((8, L // 8), (4, 4), (2, 2)),
        "sta_3d": generate_sta_mask_mod_3d((2, 4, L // 8), (2, 2, 2), (1, 2, 2)),
        "svg_spatial": generate_spatial_head_mask_mod(8, 4, (L - 8) // 4, width=1, attn_sink=True, round_width=4),
        "svg_temporal": generate_temporal_head_mask_mod(8, 4, (L - 8) // 4, width=2),
        "vsa_topk": generate_vsa_mask_mod(top_k.reshape(B, H, L // tile, 2), tile),
        "vsa_topk_padded": generate_vsa_mask_mod(top_k.reshape(B, H, L // tile, 2), tile, tile_sizes),
        "vsa_padding": generate_vsa_padding_mask_mod(tile_sizes, tile),
    }
    scores = {
        "activation_gelu": generate_activation_score_mod(),
        "activation_gelu_tanh": generate_activation_score_mod(lambda x: F.gelu(x, approximate="tanh")),
        "activation_relu": generate_activation_score_mod(F.relu, offset=0.5),
        "activation_sigmoid": generate_activation_score_mod(torch.sigmoid),
        "alibi": generate_alibi_bias(H),
        "graphormer_spatial": generate_graphormer_spatial_bias(
            torch.randn(H, 6, generator=gen), shortest_path_distances(adjacency, 4)
        ),
        "graphormer_edge": generate_graphormer_edge_bias(torch.randn(H, 3, 3, generator=gen), path_types, path_lengths),
        "mla_rope": generate_mla_rope_score_mod(
            torch.randn(B, H, L, 8, generator=gen), torch.randn(B, 1, S, 8, generator=gen), H, scale=0.5
        ),
        "sandwich": generate_sandwich_bias(H, max(L, S), d_bar=16),
        "tanh_softcap": generate_tanh_softcap(20),
        "tanh_softcap_approx": generate_tanh_softcap(20, approx=True),  # attention-gym's approx::tanh op
    }
    out.update({name: ("mask_mod", fn) for name, fn in masks.items()})
    out.update({name: ("score_mod", fn) for name, fn in scores.items()})
    return out


AG_NAMES = [
    "causal", "batchify_causal", "batchify_noop", "block_diffusion", "dilated_sliding_window", "doc_mask_causal",
    "doc_mask_noop", "packed_causal_doc", "vision_cross_attention", "global_sliding_window", "jetspec_training",
    "jetspec_tree_causal", "natten", "tiled_natten", "morton_natten", "prefix_lm", "shared_prefix",
    "sliding_window", "sta_2d", "sta_3d", "svg_spatial", "svg_temporal", "vsa_topk", "vsa_topk_padded",
    "vsa_padding", "activation_gelu", "activation_gelu_tanh", "activation_relu", "activation_sigmoid", "alibi",
    "graphormer_spatial", "graphormer_edge", "mla_rope", "sandwich", "tanh_softcap", "tanh_softcap_approx",
]  # fmt: skip
AG_SHAPE = dict(B=1, H=2, L=64, S=64)


def test_attention_gym_list_is_complete():
    pytest.importorskip("attn_gym")
    import attn_gym.masks
    import attn_gym.mods

    variants = attention_gym_variants(**AG_SHAPE, gen=torch.Generator().manual_seed(0))
    assert list(variants) == AG_NAMES
    # every factory the two packages export is used above
    factories = {n for pkg in (attn_gym.masks, attn_gym.mods) for n in dir(pkg)
                 if n.startswith("generate_") or n == "batchify_mask_mod"}  # fmt: skip
    source = inspect.getsource(attention_gym_variants)
    assert all(name in source for name in factories), sorted(n for n in factories if n not in source)


@pytest.mark.parametrize("name", AG_NAMES)
def test_attention_gym_mod_lowers_and_matches_torch(name):
    pytest.importorskip("attn_gym")
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tensors through the Triton backend)")
    B, H, L, S = AG_SHAPE.values()
    gen = torch.Generator().manual_seed(0)
    kind, fn = attention_gym_variants(B, H, L, S, gen)[name]
    # the lowered mod on tiles, lowered for these lengths and for any lengths
    for q_start, kv_start in ((0, 16), (48, 0)):
        check(fn, kind, b=0, h=1, q_start=q_start, kv_start=kv_start)
    # and end to end through the Triton backend
    q, k, v = (torch.randn(B, H, n, 16, generator=gen) for n in (L, S, S))
    if kind == "mask_mod":
        options = dict(block_mask=create_block_mask(fn, B, H, L, S, device="cpu", BLOCK_SIZE=32))
        ref = reference_attention(q.double(), k.double(), v.double(), mask_mod=fn)[0]
    else:
        options = dict(score_mod=fn)
        ref = reference_attention(q.double(), k.double(), v.double(), score_mod=fn)[0]
    out = flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON"}, **options)
    assert rel_err(out, ref) < 1e-5


def test_attention_gym_mods_are_lean_at_their_lengths():
    # In-range gathers (slopes[h], rel_bias[q - kv + offset], ...) keep plain loads at the lengths
    # the mods are built for; only indices read from data are checked.
    pytest.importorskip("attn_gym")
    B, H, L, S = AG_SHAPE.values()
    checked = set()
    for name, (kind, fn) in attention_gym_variants(B, H, L, S, torch.Generator().manual_seed(0)).items():
        traced = trace_mod(fn, kind)[0]
        variant = lowering_variant(traced, IndexBounds(B, H, L, S))
        assert not variant.wide, name
        if variant.gathers:
            checked.add(name)
    data_indexed = {"doc_mask_causal", "packed_causal_doc", "vision_cross_attention",
                    "shared_prefix", "graphormer_spatial", "graphormer_edge"}  # fmt: skip
    # Indices offset by a number the mod reads (a Python int in its closure) are checked too: the
    # kernel takes the number at run time, for any value (trace/numbers.py), so its range is not known.
    number_indexed = {"vsa_topk", "vsa_topk_padded", "vsa_padding", "mla_rope", "sandwich", "jetspec_tree_causal"}
    assert checked == data_indexed | number_indexed


def test_activation_defaults():
    check(lambda s, b, h, q, kv: F.hardtanh(s) + F.softplus(s) + F.softplus(s, 1, 3) + F.gelu(s), rtol=2e-5, atol=2e-5)
