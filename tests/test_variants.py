"""Every entry of the variant catalogue (flexattn.variants.CATALOGUE) on every backend, against the
float64 reference: the forward through BACKEND="PYTORCH" and "TRITON", gradients of q, k, v and of
every learnable tensor (attention sinks included) through both, and decoding steps through
"TRITON_DECODE" for entries with ``decode=True``. Plus the catalogue's docs: every docstring picture
is re-rendered and compared, and every entry names documented factories.

Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py), so shapes are tiny;
CI runs this file twice, keep it under ~2 minutes.
"""

import doctest
import inspect

import pytest
import torch
from numerics import expect_triton_backward, rel_err

import flexattn.kernels.decode
import flexattn.variants
from flexattn import AuxRequest, create_block_mask, decode_block_mask, flex_attention, offset_score_mod
from flexattn.variants import CATALOGUE, FAMILY_MODULES, apply_sinks, bias_picture, picture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, E, EV = 2, 2, 16, 24
SQUARE = 192  # one sequence: 12 x 16 for the 2-D layouts, 4 x 6 x 8 for the 3-D one
Q_LEN, KV_LEN = 96, 160  # entries that take any Q_LEN, KV_LEN: neither a multiple of 128
FWD_TOL = 2e-5  # fp32 inputs against the float64 reference, norm-wise relative
GRAD_TOL = 2e-5  # dq, dk, dv (measured ~3e-7 here)
LEARNABLE_TOL = 1e-4  # a learnable table's gradient sums dS over many pairs, whose terms cancel (~3e-6 here)

BACKENDS = ["PYTORCH", "TRITON"]
NAMES = list(CATALOGUE)
DECODE_NAMES = [name for name, v in CATALOGUE.items() if v.decode]

pytestmark = pytest.mark.usefixtures("one_thread")


def sizes(name):
    return (SQUARE, SQUARE) if CATALOGUE[name].square_only else (Q_LEN, KV_LEN)


def inputs(L, S, requires_grad=False):
    q = torch.randn(B, H, L, E, device=DEVICE)
    k = torch.randn(B, H, S, E, device=DEVICE)
    v = torch.randn(B, H, S, EV, device=DEVICE)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def leaves(inst):
    return list(inst.learnable) + ([inst.sinks] if inst.sinks is not None else [])


# ---------------------------------------------------------------------------------------------
# Forward and gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_forward(name, backend):
    L, S = sizes(name)
    inst = CATALOGUE[name].make(B, H, L, S, DEVICE)
    q, k, v = inputs(L, S)
    with torch.no_grad():
        out = inst.attend(q, k, v, block_mask=inst.block_mask(B, H, L, S, DEVICE), kernel_options={"BACKEND": backend})
        ref = inst.reference(q.double(), k.double(), v.double())
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the output (an element the kernel never wrote?)"
    assert rel_err(out, ref) < FWD_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_gradients(name, backend):
    L, S = sizes(name)
    inst = CATALOGUE[name].make(B, H, L, S, DEVICE)
    learnable = leaves(inst)
    assert all(t.requires_grad and t.is_leaf for t in learnable), "learnable tensors must be leaves that require grad"
    q, k, v = inputs(L, S, requires_grad=True)
    grad_out = torch.randn(B, H, L, EV, device=DEVICE)

    ref_qkv = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = inst.reference(*ref_qkv)
    expected = torch.autograd.grad(ref, ref_qkv + learnable, grad_out.double())

    block_mask = inst.block_mask(B, H, L, S, DEVICE)
    out = inst.attend(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
    if backend == "TRITON":
        with expect_triton_backward():
            actual = torch.autograd.grad(out, [q, k, v] + learnable, grad_out)
    else:
        actual = torch.autograd.grad(out, [q, k, v] + learnable, grad_out)

    names = ["dq", "dk", "dv"] + [f"d(learnable {i})" for i in range(len(learnable))]
    for i, (label, got, want) in enumerate(zip(names, actual, expected)):
        assert got.shape == want.shape and not torch.isnan(got).any(), label
        assert rel_err(got, want) < (GRAD_TOL if i < 3 else LEARNABLE_TOL), label


# ---------------------------------------------------------------------------------------------
# Decoding: the last tokens of a sequence against a KV cache, step by step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("name", DECODE_NAMES)
def test_decode(name, q_len):
    # Two steps of q_len tokens at the end of the sequence, as a decoding loop runs them: one offset
    # tensor updated in place, the step's BlockMask cut from the full one, the score_mod shifted.
    # Each step must equal the matching rows of the whole sequence's float64 reference.
    L, S = sizes(name)
    inst = CATALOGUE[name].make(B, H, L, S, DEVICE)
    q_all, k, v = inputs(L, S)
    full_mask = create_block_mask(inst.mask_mod, None, None, L, S, device=DEVICE) if inst.mask_mod else None
    with torch.no_grad():
        ref = inst.reference(q_all.double(), k.double(), v.double())
        offset = torch.zeros((), dtype=torch.int32, device=DEVICE)
        score_mod = offset_score_mod(inst.score_mod, offset) if inst.score_mod is not None else None
        for start in (L - 2 * q_len, L - q_len):
            offset.fill_(start)
            step_mask = decode_block_mask(full_mask, offset, q_len) if full_mask is not None else None
            q = q_all[:, :, start:start + q_len]
            before = flexattn.kernels.decode.launches
            out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=step_mask,
                                      return_aux=AuxRequest(lse=True), kernel_options={"BACKEND": "TRITON_DECODE"})
            assert flexattn.kernels.decode.launches > before, "the decode kernels did not run"
            if inst.sinks is not None:
                out = apply_sinks(out, aux.lse, inst.sinks)
            want = ref[:, :, start:start + q_len]
            assert not torch.isnan(out).any()
            assert rel_err(out, want) < FWD_TOL, f"step at {start}"


# ---------------------------------------------------------------------------------------------
# Documentation: true pictures, documented factories
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [*FAMILY_MODULES, flexattn.variants._pictures], ids=lambda m: m.__name__)
def test_docstring_pictures(module):
    # Every example in the module's docstrings (the mask and bias pictures, the value tables) is
    # run and its output compared with the docstring's, character for character.
    globs = {"picture": picture, "bias_picture": bias_picture, "torch": torch}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in doctest.DocTestFinder().find(module, extraglobs=globs) if t.examples]
    assert tests, f"{module.__name__} has no docstring examples"
    failed = [test.name for test in tests if runner.run(test, out=lambda text: None).failed]
    assert not failed, f"docstring examples whose output changed (re-render the pictures): {failed}"


@pytest.mark.parametrize("name", NAMES)
def test_entry_has_documented_factories(name):
    variant = CATALOGUE[name]
    assert variant.name == name and name.isidentifier() and name == name.lower()
    assert variant.family in ("mask", "score", "both") and variant.summary
    assert variant.factories, f"{name}: no factory listed"
    for factory in variant.factories:
        assert callable(factory) and not factory.__name__.startswith("_"), factory
        assert inspect.getdoc(factory), f"{name}: {factory.__name__} has no docstring"
        assert getattr(flexattn.variants, factory.__name__, None) is factory, (
            f"{name}: {factory.__name__} is not exported from flexattn.variants"
        )
    doc = variant.doc
    assert "Inputs" in doc and "Source" in doc and ">>>" in doc, f"{name}: the first factory's docstring must say " \
        "its inputs and source and show its picture"
    # What the entry contributes matches what it builds.
    inst = variant.make(1, 2, *sizes(name), DEVICE)
    has_score = inst.score_mod is not None or inst.sinks is not None
    assert variant.family == {(False, False): "score", (False, True): "mask", (True, False): "score",
                              (True, True): "both"}[(has_score, inst.mask_mod is not None)], name


def test_every_public_factory_shows_a_picture():
    for module in FAMILY_MODULES:
        for fname, fn in vars(module).items():
            if fname.startswith("generate_") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                assert ">>>" in (fn.__doc__ or ""), f"{module.__name__}.{fname} has no picture/example"


def test_picture_renders_masks_and_biases():
    assert picture(lambda b, h, q, kv: kv <= q, 2, 3) == "#--\n##-"
    assert bias_picture(lambda s, b, h, q, kv: s + kv, 1, 4) == "0369"
    assert bias_picture(lambda s, b, h, q, kv: s + kv, 2, 2, mask_mod=lambda b, h, q, kv: kv <= q) == "0-\n09"
