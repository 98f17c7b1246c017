"""FP8 inputs and mixed dtypes in the forward ([Note] Mixed and FP8 dtypes in flexattn/request.py).

- An FP8 key/value cache read by a 16-bit query: the kernels convert keys and values as they load
  them, so the result is the call on converted tensors (the same bits under the interpreter).
- FP8 query, key and value: both products in FP8, the output in FP8 (torch's semantics), within
  the error of rounding the exact result to FP8.
- A gradient needs one non-FP8 dtype: a clear error otherwise.

Without a GPU the kernels run in Triton's interpreter, whose products run in float32 ([Note]
Interpreter dots); tests/test_gpu_fp8.py runs the compiled FP8 products on the device.
"""

import contextlib

import pytest
import torch
from numerics import rel_err

import flexattn
from flexattn import create_block_mask, flex_attention
from flexattn.errors import InvalidInputError
from flexattn.kernels.hopper import common as hopper_common
from flexattn.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

pytestmark = pytest.mark.usefixtures("one_thread")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.125 * (q_idx - kv_idx).abs()


def inputs(L, S, dtype, kv_dtype, B=1, Hq=2, Hkv=2, E=32):
    # Values of a few units, as a scaled FP8 tensor holds them.
    q = torch.randn(B, Hq, L, E, device=DEVICE).to(dtype)
    k = torch.randn(B, Hkv, S, E, device=DEVICE).to(kv_dtype)
    v = torch.randn(B, Hkv, S, E, device=DEVICE).to(kv_dtype)
    return q, k, v


@contextlib.contextmanager
def expect_launches(module):
    before = module.launches
    yield
    assert module.launches > before, f"{module.__name__} did not launch"


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend, q_len", [("TRITON", 128), ("TRITON_DECODE", 4), ("PYTORCH", 128)])
def test_fp8_cache_read_by_a_16bit_query_equals_the_converted_call(kv_dtype, q_dtype, backend, q_len):
    q, k, v = inputs(q_len, 256, q_dtype, kv_dtype)
    mask = create_block_mask(lambda b, h, i, j: i + 256 - q_len >= j, 1, None, q_len, 256, device=DEVICE)
    options = {"BACKEND": backend}
    # A pinned TRITON runs the forward kernel or raises; the decode kernels are counted.
    decoding = backend == "TRITON_DECODE"
    with expect_launches(flexattn.kernels.decode) if decoding else contextlib.nullcontext():
        out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, kernel_options=options,
                                  return_aux=flexattn.AuxRequest(lse=True))
    assert out.dtype == q_dtype and aux.lse.dtype == torch.float32
    converted, converted_aux = flex_attention(q, k.to(q_dtype), v.to(q_dtype), score_mod=alibi, block_mask=mask,
                                              kernel_options=options, return_aux=flexattn.AuxRequest(lse=True))
    if DEVICE == "cpu" and (q_dtype == torch.float16 or backend == "PYTORCH"):
        # The interpreter's products of the converted tiles: the same values, the same bits.
        assert torch.equal(out, converted) and torch.equal(aux.lse, converted_aux.lse)
    else:
        # A bfloat16 query's products run in float16 ([Note] An FP8 cache read by a bfloat16 query),
        # and compiled products of FP8-loaded tiles may sum in another order.
        assert rel_err(out, converted) < 4e-3 and rel_err(aux.lse, converted_aux.lse) < 1e-5
    ref, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), alibi,
                                          lambda b, h, i, j: i + 256 - q_len >= j)
    assert rel_err(out, ref) < 2e-2 and rel_err(aux.lse, ref_lse) < 1e-2
    if q_dtype == torch.bfloat16 and backend != "PYTORCH":  # no worse than the converted call
        assert rel_err(out, ref) <= rel_err(converted, ref) * 1.05


@pytest.mark.parametrize("magnitude", [1e-6, 1e6, 1e30])
@pytest.mark.parametrize("backend, q_len", [("TRITON", 128), ("TRITON_DECODE", 4)])
def test_a_bfloat16_query_of_any_range_reads_an_fp8_cache_exactly(magnitude, backend, q_len):
    # Outside float16's range (65504, and 6e-5 for normal numbers): the query is scaled by a power
    # of two into it before its products run in float16. Without that, 1e6 gives inf and NaN, and
    # 1e-6 loses most of its bits.
    q, k, v = inputs(q_len, 256, torch.float32, torch.float8_e4m3fn)
    q = (q * magnitude).bfloat16()
    scale = 0.5 / magnitude
    out, aux = flex_attention(q, k, v, scale=scale, kernel_options={"BACKEND": backend},
                              return_aux=flexattn.AuxRequest(lse=True))
    ref, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), scale=scale)
    assert rel_err(out, ref) < 1e-2 and rel_err(aux.lse, ref_lse) < 1e-5


def fp8_budget(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the error of the exact result rounded to ``dtype``: what any FP8 output must pay, with
    the flash-attention rule's factor for the rest (P rounded to FP8 on the GPU)."""
    return 2 * rel_err(ref.to(dtype), ref) + 1e-3


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend, q_len", [("TRITON", 256), ("PYTORCH", 256), ("TRITON_DECODE", 8)])
def test_fp8_query_key_value_within_twice_the_rounding_of_the_exact_result(dtype, backend, q_len):
    q, k, v = inputs(q_len, 256, dtype, dtype, Hq=4, Hkv=2)
    mask = create_block_mask(causal, 1, None, q_len, 256, device=DEVICE)
    out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True,
                              kernel_options={"BACKEND": backend}, return_aux=flexattn.AuxRequest(lse=True))
    assert out.dtype == dtype
    ref, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), alibi, causal, enable_gqa=True)
    assert rel_err(out, ref) < fp8_budget(ref, dtype)
    assert rel_err(aux.lse, ref_lse) < 1e-4  # the scores are exact: FP8 products sum in float32


def test_a_plan_is_not_shared_across_key_dtypes():
    # Same shapes and strides, another key/value dtype: a plan keyed without it would launch the
    # first call's choices (descriptors, tiles) with the second call's tensors.
    def causal_once(b, h, q_idx, kv_idx):  # a mod of its own: a kernel family no other test has used
        return q_idx >= kv_idx

    mask = create_block_mask(causal_once, 1, None, 128, 128, device=DEVICE)
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16):
        q, k, v = inputs(128, 128, torch.bfloat16, kv_dtype)
        out = flex_attention(q, k, v, block_mask=mask, kernel_options={"BACKEND": "TRITON"})
        ref = reference_attention(q.double(), k.double(), v.double(), None, causal_once)[0]
        assert rel_err(out, ref) < 2e-2
    family = next(f for f in flexattn.kernels.forward._kernels.values() if f.mask and f.mask.name == "causal_once")
    assert len(family._plans) == 2  # one per key/value dtype


def test_a_gradient_needs_one_dtype_that_is_not_fp8():
    q, k, v = inputs(128, 128, torch.float8_e4m3fn, torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match=r"FP8 inputs are forward-only.*torch.no_grad\(\)"):
        flex_attention(q.requires_grad_(), k, v)
    q, k, v = inputs(128, 128, torch.bfloat16, torch.float8_e5m2)
    with pytest.raises(InvalidInputError, match=r"FP8 inputs are forward-only \(query torch.bfloat16, key "
                                                r"torch.float8_e5m2"):
        flex_attention(q.requires_grad_(), k, v)
    with torch.no_grad():  # the same call without a gradient runs
        assert flex_attention(q, k, v).dtype == torch.bfloat16


def test_the_gluon_kernels_say_why_they_take_one_16bit_dtype():
    q, k, v = inputs(128, 128, torch.bfloat16, torch.float8_e4m3fn)
    mask = create_block_mask(causal, 1, None, 128, 128, device=DEVICE)
    reason = hopper_common.shape_reason(q, k, v, mask, False)
    assert reason == ("the Gluon kernel takes a query, key and value of one dtype, float16 or bfloat16, got "
                      "bfloat16, float8_e4m3fn, float8_e4m3fn")


def test_fp8_cache_under_torch_compile_equals_eager():
    torch._dynamo.reset()
    q, k, v = inputs(128, 128, torch.bfloat16, torch.float8_e4m3fn)
    mask = create_block_mask(causal, 1, None, 128, 128, device=DEVICE)
    options = {"BACKEND": "PYTORCH"}
    compiled = torch.compile(flex_attention, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, block_mask=mask, kernel_options=options)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, flex_attention(q, k, v, block_mask=mask, kernel_options=options))
    torch._dynamo.reset()
