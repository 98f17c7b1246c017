"""The public API: drop-in parity with torch, outputs, autograd through it, and one test per bad input."""

import inspect
import math

import pytest
import torch
from numerics import rel_err

import flexattn
from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.errors import InvalidInputError, ModTraceError, UnsupportedOpError
from flexattn.reference import reference_attention
from flexattn.variants import causal_mask, generate_alibi_bias

import os

PYTORCH = {"BACKEND": "PYTORCH"}
TRITON = {"BACKEND": "TRITON"}  # CPU tensors: runs in Triton's interpreter (tests/conftest.py)
# On a GPU machine Triton is not interpreted, so the Triton backend cannot take these CPU tensors.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)




def qkv(B=1, H=2, L=64, S=64, E=16, Ev=16, dtype=torch.float32, **kw):
    return (
        torch.randn(B, H, L, E, dtype=dtype, **kw),
        torch.randn(B, H, S, E, dtype=dtype, **kw),
        torch.randn(B, H, S, Ev, dtype=dtype, **kw),
    )


# ------------------------------------------------------------------------------ drop-in parity


def test_public_names_and_signatures_match_torch():
    import torch.nn.attention.flex_attention as tfa

    for name in ("flex_attention", "create_block_mask", "create_mask", "and_masks", "or_masks", "noop_mask",
                 "BlockMask", "AuxRequest", "AuxOutput", "FlexKernelOptions"):
        assert hasattr(flexattn, name), name
    ours = inspect.signature(flexattn.flex_attention).parameters
    theirs = inspect.signature(tfa.flex_attention).parameters
    assert list(ours) == list(theirs)
    ours = list(inspect.signature(flexattn.create_block_mask).parameters)
    assert ours[:7] == list(inspect.signature(tfa.create_block_mask).parameters)[:7]
    assert flexattn.and_mask is flexattn.and_masks and flexattn.or_mask is flexattn.or_masks


def test_cpu_default_is_the_pytorch_backend_and_matches_reference():
    q, k, v = qkv(L=200, S=300)
    alibi = generate_alibi_bias(2)
    bm = create_block_mask(causal_mask, None, None, 200, 300, device="cpu", BLOCK_SIZE=64)
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=alibi, mask_mod=causal_mask)
    assert rel_err(out, ref) < 1e-5


def test_return_lse_is_deprecated_but_works_and_aux_fields_are_optional():
    q, k, v = qkv()
    with pytest.warns(FutureWarning):
        out, lse = flex_attention(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 64) and lse.dtype == torch.float32
    out2, aux = flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == (1, 2, 64)
    assert torch.allclose(out, out2)


@pytest.mark.parametrize("backend", [PYTORCH, pytest.param(TRITON, marks=needs_interpreter)])
def test_training_through_the_api_with_a_learnable_bias(backend):
    L = 96
    bias = torch.randn(2, L, L, dtype=torch.float32, requires_grad=True)

    def learned_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    q, k, v = qkv(L=L, S=L, requires_grad=True)
    bm = create_block_mask(causal_mask, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=learned_bias, block_mask=bm, kernel_options=backend)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    q64, k64, v64, bias64 = leaves

    def learned_bias64(score, b, h, q_idx, kv_idx):
        return score + bias64[h, q_idx, kv_idx]

    ref, _, _ = reference_attention(q64, k64, v64, score_mod=learned_bias64, mask_mod=causal_mask)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    for name, g, r in zip("q k v bias".split(), grads, ref_grads):
        assert rel_err(g, r) < 1e-4, name


def test_fully_masked_rows_have_no_nan_in_forward_or_backward():
    def nothing_for_early_rows(b, h, q_idx, kv_idx):
        return (q_idx >= 10) & (kv_idx <= q_idx)

    q, k, v = qkv(L=48, S=48, requires_grad=True)
    bm = create_block_mask(nothing_for_early_rows, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    out, aux = flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))
    assert torch.all(out[:, :, :10] == 0) and torch.all(aux.lse[:, :, :10] == -math.inf)
    (out.sum() + aux.lse[:, :, 10:].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gqa_and_kv_batch_broadcast():
    q = torch.randn(2, 4, 64, 16)
    k, v = torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 24)
    out = flex_attention(q, k, v, enable_gqa=True)
    ref, _, _ = reference_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert out.shape == (2, 4, 64, 24) and rel_err(out, ref) < 1e-5


# ------------------------------------------------------------------------------ bad inputs


def test_error_query_not_4d():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"query must be 4-D .*got shape \[2, 64, 16\]"):
        flex_attention(q[0], k, v)


def test_error_dtypes_differ_names_the_conversion():
    # A gradient needs one dtype; without one, key and value of another dtype are converted to the
    # query's (tests/test_fp8.py).
    q, k, v = qkv()
    q.requires_grad_()
    with pytest.raises(InvalidInputError, match=r"one dtype.*float32.*float64.*convert key, e.g. key.to\(torch.float32\)"):
        flex_attention(q, k.double(), v)
    # issue 19: a float32 query with bf16 keys and values: the query is the odd one out.
    with pytest.raises(InvalidInputError, match=r"convert query, e.g. query.to\(torch.bfloat16\)"):
        flex_attention(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(InvalidInputError, match=r"convert them to one, e.g. key.to\(query.dtype\)"):
        flex_attention(q, k.bfloat16(), v.half())


def test_error_integer_dtype():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="value must be float16, bfloat16, float32, float64, float8_e4m3fn or"):
        flex_attention(q, k, v.long())


def test_error_devices_differ():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="one device"):
        flex_attention(q, k.to("meta"), v)


def test_error_batch_mismatch():
    q, k, v = qkv(B=2)
    with pytest.raises(InvalidInputError, match=r"key/value batch must equal the query batch \(2\) or be 1"):
        flex_attention(q, torch.cat([k, k[:1]]), torch.cat([v, v[:1]]))


def test_error_gqa_needs_enable_gqa():
    q = torch.randn(1, 4, 32, 16)
    k = v = torch.randn(1, 2, 32, 16)
    with pytest.raises(InvalidInputError, match="enable_gqa=True"):
        flex_attention(q, k, v)


@pytest.mark.parametrize("enable_gqa", [True, False])
def test_error_gqa_heads_not_multiple(enable_gqa):
    # issue 19: without enable_gqa, 6 query heads over 4 key/value heads once advised enable_gqa=True,
    # which then failed; the divisibility comes first either way.
    q = torch.randn(1, 6, 32, 16)
    k = v = torch.randn(1, 4, 32, 16)
    with pytest.raises(InvalidInputError, match=r"query has 6 heads and key/value have 4: .*6 is not a multiple of 4") as err:
        flex_attention(q, k, v, enable_gqa=enable_gqa)
    assert "pass enable_gqa" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_error_device_cuda_without_cuda_names_the_argument_and_the_fix():
    # issue 19: torch's bare "AssertionError: Torch not compiled with CUDA enabled" before.
    import flexattn

    calls = {
        "create_block_mask": lambda: create_block_mask(causal_mask, 1, 1, 64, 64, device="cuda"),
        "create_mask": lambda: flexattn.create_mask(causal_mask, 1, 1, 64, 64, device=torch.device("cuda:0")),
        "offset_mask_mod": lambda: flexattn.offset_mask_mod(causal_mask, 3, device="cuda"),
        "PagedAttention": lambda: flexattn.PagedAttention(4, 128, 2, device="cuda"),
    }
    for where, call in calls.items():
        with pytest.raises(InvalidInputError) as err:
            call()
        message = str(err.value)
        assert message.startswith(f"{where}: device='cuda") and "CUDA is not available here" in message, message
        assert "device=q.device" in message and "device='cpu'" in message


def test_error_head_dims_differ():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"same head_dim, got 16 \(query\) and 8 \(key\)"):
        flex_attention(q, k[..., :8], v)


def test_error_key_value_lengths_differ():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="key and value must agree"):
        flex_attention(q, k, v[:, :, :10])


def test_error_block_mask_for_other_lengths():
    q, k, v = qkv(L=64, S=64)
    bigger = create_block_mask(causal_mask, 1, 1, 128, 128, device="cpu")
    with pytest.raises(InvalidInputError, match=r"Q_LEN=128, KV_LEN=128.*adjust"):
        flex_attention(q, k, v, block_mask=bigger)
    smaller = create_block_mask(causal_mask, 1, 1, 32, 32, device="cpu")
    with pytest.raises(InvalidInputError, match="create a new block mask"):
        flex_attention(q, k, v, block_mask=smaller)


def test_error_block_mask_heads():
    q, k, v = qkv(H=2)
    bm = create_block_mask(causal_mask, 1, 3, 64, 64, device="cpu")
    with pytest.raises(InvalidInputError, match="block_mask has batch 1 and heads 3"):
        flex_attention(q, k, v, block_mask=bm)


def test_error_block_mask_wrong_type():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="block_mask must be a flexattn.BlockMask"):
        flex_attention(q, k, v, block_mask=torch.ones(64, 64, dtype=torch.bool))


def test_error_score_mod_arity():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"score_mod two_args\(score, b\), which takes 2 required positional arguments; a score_mod takes exactly 5"):
        def two_args(score, b):
            return score
        flex_attention(q, k, v, score_mod=two_args)


def test_error_mask_mod_passed_as_score_mod_and_the_reverse():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"flex_attention got score_mod=causal_mask\(b, h, q_idx, kv_idx\), "
                                                r"which takes 4 arguments: that is a mask_mod.*block_mask=create_block_mask"):
        flex_attention(q, k, v, score_mod=causal_mask)
    bm = create_block_mask(causal_mask, 1, 1, 64, 64, device="cpu")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx)

    bm.mask_mod = alibi  # a score_mod where the mask_mod belongs
    with pytest.raises(InvalidInputError, match=r"flex_attention \(block_mask.mask_mod\) got alibi\(score, b, h, "
                                                r"q_idx, kv_idx\), which takes 5 arguments: that is a score_mod"):
        flex_attention(q, k, v, block_mask=bm)

    def two(q_idx, kv_idx):
        return q_idx >= kv_idx

    bm.mask_mod = two
    with pytest.raises(InvalidInputError, match=r"mask_mod two\(q_idx, kv_idx\), which takes 2 required positional "
                                                r"arguments; a mask_mod takes exactly 4: \(b, h, q_idx, kv_idx\)"):
        flex_attention(q, k, v, block_mask=bm)


def test_error_sequence_major_inputs_say_transpose():
    # [B, L, H, D] passed where [B, H, L, D] belongs: the mask's lengths are the inputs' dim 1.
    B, L, H, D = 1, 128, 4, 16
    q, k, v = (torch.randn(B, L, H, D) for _ in range(3))
    bm = create_block_mask(causal_mask, None, None, L, L, device="cpu")
    with pytest.raises(InvalidInputError, match=r"look like \[batch, seq_len, heads, head_dim\].*q.transpose\(1, 2\)"):
        flex_attention(q, k, v, block_mask=bm)
    out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm)
    assert out.shape == (B, H, L, D)


def test_error_score_mod_returns_wrong_shape():
    q, k, v = qkv()
    table = torch.randn(2, 8)

    def wrong_shape(score, b, h, q_idx, kv_idx):
        return score + table[h]

    with pytest.raises(ModTraceError, match=r"one value per \(query, key\) pair.*shape \(8,\)"):
        flex_attention(q, k, v, score_mod=wrong_shape)


def test_error_score_mod_returns_bool():
    q, k, v = qkv()
    with pytest.raises(ModTraceError, match="floating-point score.*did you pass a mask_mod"):
        flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: q_idx >= kv_idx)


def test_error_mod_with_python_control_flow_names_line_and_fix():
    q, k, v = qkv()

    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score * 2

    with pytest.raises(ModTraceError) as info:
        flex_attention(q, k, v, score_mod=branchy)
    message = str(info.value)
    assert "score_mod 'branchy'" in message and "if q_idx > kv_idx:" in message and "torch.where" in message
    assert "test_api.py" in message


@needs_interpreter
def test_error_unsupported_op_names_op_mod_and_line():
    q, k, v = qkv()

    def sorted_score(score, b, h, q_idx, kv_idx):
        return score + torch.cumsum(score.reshape(1), 0)[0]

    with pytest.raises((UnsupportedOpError, ModTraceError)) as info:
        flex_attention(q, k, v, score_mod=sorted_score, kernel_options=TRITON)
    message = str(info.value)
    assert "cumsum" in message and "sorted_score" in message


def test_error_captured_tensor_on_other_device():
    q, k, v = qkv()
    slopes = torch.randn(2, device="meta")

    def on_meta(score, b, h, q_idx, kv_idx):
        return score + slopes[h]

    with pytest.raises(InvalidInputError, match="reads the tensor 'slopes' on meta"):
        flex_attention(q, k, v, score_mod=on_meta)


def test_error_unknown_kernel_option_and_backend():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"unknown kernel_options \['BLOCK_SIZE'\]"):
        flex_attention(q, k, v, kernel_options={"BLOCK_SIZE": 64})
    with pytest.raises(ValueError, match="BACKEND"):
        flex_attention(q, k, v, kernel_options={"BACKEND": "CUDA"})


@needs_interpreter
def test_error_pinned_block_size_must_divide_mask_blocks():
    q, k, v = qkv(L=128, S=128)
    with pytest.raises(InvalidInputError, match=r"kernel_options\['BLOCK_N'\] must be a power of two"):
        flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON", "BLOCK_N": 48})


def test_error_return_lse_and_return_aux_together():
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match="either return_lse or return_aux"):
        flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))


def test_version_matches_pyproject():
    import re

    import flexattn

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    assert flexattn.__version__ == declared


def test_help_of_kernel_options_describes_every_option():
    from flexattn import FlexKernelOptions

    doc = FlexKernelOptions.__doc__
    for key in FlexKernelOptions.__annotations__:
        assert f"\n{key}: " in doc, key
    assert "Query rows per Triton program" in doc  # BLOCK_M's own description


# ------------------------------------------------------------------------------ FLEXATTN_DEBUG


_DEBUG_SCRIPT = """
import torch
from flexattn import create_block_mask, flex_attention
from flexattn.variants import causal_mask

slopes = torch.rand(2)
def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)

bm = create_block_mask(causal_mask, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
for backend in BACKENDS:
    decode = backend == "TRITON_DECODE"  # inference only, and its queries fit one block of the mask
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=not decode) for _ in range(3))
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=None if decode else bm,
                         kernel_options={"BACKEND": backend})
    if not decode:
        out.sum().backward()
"""


def _run_debug_script(tmp_path, backends, debug: str):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "FLEXATTN_DEBUG": debug, "FLEXATTN_CACHE_DIR": str(tmp_path)}
    ran = subprocess.run([sys.executable, "-c", f"BACKENDS = {backends!r}\n" + _DEBUG_SCRIPT], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    return ran.stderr


def test_flexattn_debug_names_backend_and_plan_on_the_pytorch_backend(tmp_path):
    # issue 19: FLEXATTN_DEBUG=1 printed nothing on CPU, where no kernel is generated.
    lines = [line for line in _run_debug_script(tmp_path, ["PYTORCH"], "1").splitlines() if "[flexattn]" in line]
    assert len(lines) == 2, lines
    forward, backward = lines
    assert forward.startswith("[flexattn] forward PYTORCH: q [1, 2, 64, 16] k [1, 2, 64, 16] v [1, 2, 64, 16] "
                              "float32 on cpu, score_mod=alibi, mask_mod=causal_mask, BlockMask 32x32; blockwise:")
    assert "query tiles of up to 32 rows" in forward and "int32 indices" in forward
    assert backward.startswith("[flexattn] backward PYTORCH: ")
    assert "[flexattn]" not in _run_debug_script(tmp_path, ["PYTORCH"], "0")


def test_the_debug_report_of_a_recorded_run_reads_no_plan():
    """Kernels compiled ahead record a first call's launches without running them: no plan is kept,
    so the report must not read one. It did, and the AttributeError ended the head start of every
    first backward under FLEXATTN_DEBUG=1 (seen on an H200)."""
    from flexattn import dispatch
    from flexattn.kernels import ahead

    def plan():
        raise AssertionError("a recorded run has no plan to report")

    with ahead.compiling_ahead():
        dispatch._debug_report("backward", None, None, None, None, plan)


@needs_interpreter
def test_flexattn_debug_names_tiles_and_kernel_files_on_the_triton_backends(tmp_path):
    stderr = _run_debug_script(tmp_path, ["TRITON", "TRITON_DECODE"], "1")
    lines = [line for line in stderr.splitlines() if "] forward TRITON" in line or "] backward TRITON" in line]
    assert len(lines) == 3, stderr
    forward, backward, decode = lines
    assert "score_mod=alibi, mask_mod=causal_mask, BlockMask 32x32; BLOCK_M=" in forward
    assert "num_warps=" in forward and "num_stages=" in forward
    assert "dK/dV BLOCK_M=" in backward and "; dQ BLOCK_M=" in backward
    assert decode.startswith("[flexattn] forward TRITON_DECODE: ") and "NUM_SPLITS=" in decode
    for line, prefix in ((forward, "fwd_alibi_causal_mask_"), (backward, "bwd_alibi_causal_mask_"),
                         (decode, "dec_alibi_none_")):
        path = line.rsplit("kernel ", 1)[1]
        assert os.path.basename(path).startswith(prefix) and os.path.isfile(path), line
        assert path.startswith(str(tmp_path))
