"""torch's objects in flexattn and flexattn's in torch: BlockMask (torch's create_block_mask,
attention-gym, PagedAttention), AuxRequest, as_tuple and pytree registration."""

import os
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as tfa
import torch.utils._pytree as pytree
from numerics import rel_err

import flexattn
from flexattn import AuxOutput, BlockMask, create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import causal_mask

interpreter = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BACKENDS = [
    {"BACKEND": "PYTORCH"},
    pytest.param({"BACKEND": "TRITON"}, marks=pytest.mark.skipif(not interpreter, reason="needs TRITON_INTERPRET=1")),
]


def qkv(B=1, H=2, L=256, S=256, E=32):
    return torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E)


def reference(q, k, v, mask_mod=None):
    return reference_attention(q.double(), k.double(), v.double(), mask_mod=mask_mod)


def document_mask(L: int, lengths: list[int]):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert doc.numel() == L

    def same_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return same_document


@pytest.mark.parametrize("options", BACKENDS)
@pytest.mark.parametrize("kind", ["causal", "document"])
def test_torch_built_block_masks(kind, options, one_thread):
    L = 256
    mask_mod = causal_mask if kind == "causal" else document_mask(L, [70, 30, 100, 56])
    theirs = tfa.create_block_mask(mask_mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    q, k, v = qkv(L=L, S=L)
    out, aux = flex_attention(q, k, v, block_mask=theirs, kernel_options=options,
                              return_aux=tfa.AuxRequest(lse=True, max_scores=True))
    ref, ref_lse, ref_max = reference(q, k, v, mask_mod)
    assert isinstance(aux, AuxOutput)
    assert rel_err(out, ref) < 2e-5 and rel_err(aux.lse, ref_lse) < 2e-5 and rel_err(aux.max_scores, ref_max) < 2e-5


def test_attention_gym_masks(one_thread):
    attn_gym = pytest.importorskip("attn_gym.masks")
    L = 256
    for mask_mod in (attn_gym.generate_sliding_window(48), attn_gym.generate_prefix_lm_mask(40)):
        theirs = tfa.create_block_mask(mask_mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
        q, k, v = qkv(L=L, S=L)
        out = flex_attention(q, k, v, block_mask=theirs)
        assert rel_err(out, reference(q, k, v, mask_mod)[0]) < 2e-5


@pytest.mark.parametrize("options", BACKENDS)
def test_paged_attention_converted_mask(options, one_thread):
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    B, H, S, E, page, n_pages = 2, 2, 128, 32, 32, 10
    paged = PagedAttention(n_pages, page, B, device="cpu")
    k_cache, v_cache = torch.zeros(1, H, n_pages * page, E), torch.zeros(1, H, n_pages * page, E)
    q, k, v = qkv(B=B, H=H, L=S, S=S, E=E)
    for b in range(B):
        paged.reserve(torch.tensor(b), torch.tensor(S))
    paged.assign(torch.arange(B), torch.arange(S).expand(B, S), k, v, k_cache, v_cache)
    logical = tfa.create_block_mask(causal_mask, B, 1, S, S, device="cpu", BLOCK_SIZE=page)
    physical = paged.convert_logical_block_mask(logical)
    # Physical rows list pages in page-table order, not ascending: the conversion sorts them.
    out = flex_attention(q, k_cache, v_cache, block_mask=physical, kernel_options=options)
    assert rel_err(out, reference(q, k, v, causal_mask)[0]) < 2e-5


def test_conversion_is_kept_on_the_torch_mask_and_redone_when_its_tables_change(one_thread):
    L = 256
    q, k, v = qkv(L=L, S=L)
    window = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 40  # noqa: E731
    theirs = tfa.create_block_mask(causal_mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    flex_attention(q, k, v, block_mask=theirs)
    first = theirs._flexattn_block_mask[1]
    flex_attention(q, k, v, block_mask=theirs)
    assert theirs._flexattn_block_mask[1] is first  # converted once
    other = tfa.create_block_mask(window, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(theirs, name).copy_(getattr(other, name))  # in place: same objects, new contents
    theirs.mask_mod = window
    out = flex_attention(q, k, v, block_mask=theirs)
    assert rel_err(out, reference(q, k, v, window)[0]) < 2e-5


def test_our_block_mask_in_torch_code(one_thread):
    L = 256
    ours = create_block_mask(causal_mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    theirs = tfa.create_block_mask(causal_mask, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    mine, torchs = ours.as_tuple(), theirs.as_tuple()
    assert len(mine) == len(torchs)
    for a, b in zip(mine, torchs):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert ours.as_tuple(flatten=False)[0] == (L, L) and ours.as_tuple(flatten=False)[-2] == (64, 64)
    q, k, v = qkv(L=L, S=L)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's eager flex_attention says it is unfused
        out = tfa.flex_attention(q, k, v, block_mask=ours)
    assert rel_err(out, reference(q, k, v, causal_mask)[0]) < 2e-5


def test_block_mask_is_a_pytree_node(one_thread):
    ours = create_block_mask(causal_mask, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=32)
    leaves, spec = pytree.tree_flatten(ours)
    assert len(leaves) == 8 and all(isinstance(t, torch.Tensor) for t in leaves)
    copy = pytree.tree_map(lambda t: t.clone(), ours)
    assert isinstance(copy, BlockMask) and copy.mask_mod is ours.mask_mod
    assert copy.seq_lengths == ours.seq_lengths and copy.BLOCK_SIZE == ours.BLOCK_SIZE
    assert all(torch.equal(a, b) and a is not b for a, b in zip(pytree.tree_leaves(copy), leaves))
    q, k, v = qkv(L=128, S=128)
    assert rel_err(flex_attention(q, k, v, block_mask=copy), reference(q, k, v, causal_mask)[0]) < 2e-5


def test_torch_aux_request_and_return_types():
    q, k, v = qkv(L=64, S=64)
    out, aux = flex_attention(q, k, v, return_aux=tfa.AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == (1, 2, 64)
    with pytest.raises(flexattn.errors.InvalidInputError, match="return_aux must be a flexattn.AuxRequest"):
        flex_attention(q, k, v, return_aux=(True, False))
