"""Lowering: golden source for a handful of mods, and every table entry run through Triton.

The numerical tests render a standalone kernel around the lowered body (q_idx/kv_idx tiles, a
random float32 score tile), run it with the Triton interpreter on CPU and compare it with the same
mod evaluated by torch.vmap over the tile: the user's callable is the spec.

They need a process started with TRITON_INTERPRET=1 (tests/conftest.py sets it where there is no
GPU); elsewhere they skip, and the GPU test at the end compiles the same kernels for real.
"""

import os

import ast
import atexit
import hashlib
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jinja2
import pytest
import torch

from flexattn.errors import UnsupportedOpError
from flexattn.lowering.ranges import CONSERVATIVE_BOUNDS
from flexattn.lowering import (
    LOWERINGS,
    IndexBounds,
    ModInputs,
    lower,
    lowering_variant,
    needs_wide_indices,
    register_lowering,
)
from flexattn.trace import GetItemToIndex, trace_mod
from flexattn.variants import CATALOGUE, causal_mask, generate_alibi_bias

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "flexattn" / "templates"

# -- the harness ---------------------------------------------------------------------------------

HARNESS = """\
import triton
import triton.language as tl

{% include "mod_helpers.py.jinja" %}


@triton.jit
def mod_kernel(
    out_ptr, score_ptr, b, h, q_start, kv_start,
    {%- for p in params %} {{ p }},{% endfor %}
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # b and h as scalar tensors, as in the real kernels (program ids); a plain int argument equal to
    # 1 would be specialised to a constexpr.
    off_z = tl.full([], b, tl.int32)
    off_hq = tl.full([], h, tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = (q_start + offs_m)[:, None]
    kv_idx = (kv_start + offs_n)[None, :]
    tile = offs_m[:, None] * BLOCK_N + offs_n[None, :]
    qk = tl.load(score_ptr + tile)
{{ body | indent(4, first=True) }}
    result = tl.broadcast_to({{ result }}, [BLOCK_M, BLOCK_N])
    tl.store(out_ptr + tile, result{{ ".to(tl.int8)" if mask else "" }})
"""

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined)
_DIR = pathlib.Path(tempfile.mkdtemp(prefix="flexattn_test_lowering_"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)  # the harness modules live only for the run
_MODULES: dict = {}


def render(lowered, mask: bool) -> str:
    return _ENV.from_string(HARNESS).render(
        params=lowered.kernel_params, body=lowered.body, result=lowered.result, mask=mask
    )


def compile_kernel(source: str):
    """Import rendered source from a real file (Triton's @jit reads its functions' source)."""
    if source not in _MODULES:
        name = "mod_" + hashlib.sha1(source.encode()).hexdigest()[:16]
        path = _DIR / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[source] = module.mod_kernel
    return _MODULES[source]


# Triton decides at import time whether its own library functions are interpreted, so these
# interpreter runs need a process that started with TRITON_INTERPRET=1 (tests/conftest.py does so on
# machines without a GPU). On a GPU machine test_compiled_on_gpu checks the same cases compiled.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def run_kernel(fn, kind, score, *, b, h, q_start, kv_start, bounds=None, **lower_options):
    """The lowered mod on one tile; ``bounds``: lower for those lengths (None: for any lengths)."""
    if not INTERPRETED:
        pytest.skip("needs a process started with TRITON_INTERPRET=1; test_compiled_on_gpu covers GPUs")
    traced, captured = trace_mod(fn, kind)
    variant = lowering_variant(traced, bounds) if bounds is not None else None
    lowered = lower(traced, prefix="sm_" if kind == "score_mod" else "mm_", variant=variant, **lower_options)
    mask = kind == "mask_mod"
    kernel = compile_kernel(render(lowered, mask))
    M, N = score.shape
    out = torch.empty(M, N, dtype=torch.int8 if mask else torch.float32)
    extra = [x for t in captured for x in ((t, *t.stride()) if isinstance(t, torch.Tensor) else (t,))]
    kernel[(1,)](out, score, b, h, q_start, kv_start, *extra, BLOCK_M=M, BLOCK_N=N)
    return out.bool() if mask else out


def run_reference(fn, kind, score, *, b, h, q_start, kv_start, index_dtype=torch.int32):
    """The mod itself, vmapped over the tile (int64 indices where the mod needs wide indices)."""
    M, N = score.shape
    b_, h_ = torch.tensor(b, dtype=index_dtype), torch.tensor(h, dtype=index_dtype)
    q = torch.arange(q_start, q_start + M, dtype=index_dtype)
    kv = torch.arange(kv_start, kv_start + N, dtype=index_dtype)

    def one(s, q_idx, kv_idx):
        return fn(s, b_, h_, q_idx, kv_idx) if kind == "score_mod" else fn(b_, h_, q_idx, kv_idx)

    with GetItemToIndex():
        out = torch.vmap(torch.vmap(one, in_dims=(0, None, 0)), in_dims=(0, 0, None))(score, q, kv)
    return out.expand(M, N) if kind == "mask_mod" else out.float().expand(M, N)


def tile_bounds(b, h, q_start, kv_start, M, N) -> IndexBounds:
    """The smallest lengths that contain one tile: what a kernel for exactly that tile may assume."""
    return IndexBounds(B=b + 1, H=h + 1, Q_LEN=q_start + M, KV_LEN=kv_start + N)


def check(fn, kind="score_mod", *, b=1, h=2, q_start=0, kv_start=5, M=16, N=16, rtol=1e-5, atol=1e-5, score=None):
    """The lowered mod and the mod itself agree on one tile (q_start < kv_start: negative q - kv),
    lowered for any lengths and for the tile's own lengths."""
    gen = torch.Generator().manual_seed(0)
    score = torch.randn(M, N, generator=gen) * 3 if score is None else score
    where = dict(b=b, h=h, q_start=q_start, kv_start=kv_start)
    bounds = tile_bounds(b, h, q_start, kv_start, M, N)
    traced = trace_mod(fn, kind)[0]
    for lowered_for in (None, bounds):
        # The contract: the kernel lowered for some lengths computes what torch computes with the index
        # dtype the vmap paths use at those lengths (int64 where needs_wide_indices says so).
        wide = needs_wide_indices(traced, CONSERVATIVE_BOUNDS if lowered_for is None else lowered_for)
        want = run_reference(fn, kind, score, **where, index_dtype=torch.int64 if wide else torch.int32)
        got = run_kernel(fn, kind, score, **where, bounds=lowered_for)
        if kind == "mask_mod":
            assert torch.equal(got, want), f"{(got != want).sum()} of {got.numel()} mask entries differ ({lowered_for})"
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{m} ({lowered_for})")


# Lengths the golden sources are written for: every gather below is in range there (the source for
# unknown lengths, with int64 sums and checked gathers, is in test_lowering_types.py).
GOLDEN_BOUNDS = IndexBounds(B=2, H=4, Q_LEN=32, KV_LEN=32)


def lowered_of(fn, kind="score_mod", bounds=GOLDEN_BOUNDS, **options):
    traced = trace_mod(fn, kind)[0]
    variant = lowering_variant(traced, bounds) if bounds is not None else None
    return lower(traced, variant=variant, **options)


# -- captured tensors used below -------------------------------------------------------------------

_gen = torch.Generator().manual_seed(1)
SLOPES = torch.exp2(-torch.arange(1, 5, dtype=torch.float32))
BIAS = torch.randn(4, 64, generator=_gen)  # bias[h, q - kv + 31]
BIAS_T = torch.randn(64, 4, generator=_gen).t()  # same shape, transposed strides (1, 4)
TABLE3 = torch.randn(4, 32, 32, generator=_gen)
DOC = torch.tensor([0] * 5 + [1] * 9 + [2] * 10 + [3] * 8, dtype=torch.int32)  # 32 tokens
INTERVALS = torch.tensor([[0, 5], [5, 14], [14, 24], [24, 32]], dtype=torch.int64)  # [start, end) per doc
OFFSETS64 = torch.tensor([3, -7, 2**33, 11], dtype=torch.int64)
KEEP = torch.rand(32, generator=_gen) > 0.5
SMALL8 = torch.randint(0, 4, (32,), dtype=torch.int8, generator=_gen)
HALF = torch.randn(32, generator=_gen).half()
BF16 = torch.randn(32, generator=_gen).bfloat16()
F64 = torch.randn(64, generator=_gen, dtype=torch.float64)
SCALE = torch.tensor(0.125)  # a 0-d captured tensor (read with one scalar load)

# -- golden source -------------------------------------------------------------------------------


def alibi_like(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def bias_2d(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + 31]


def interval_mask(b, h, q_idx, kv_idx):
    start = INTERVALS[DOC[q_idx]][0]  # index, then select: one load at doc * stride0
    end = INTERVALS[DOC[q_idx], 1]  # the int index becomes a constant: + stride1
    return (kv_idx >= start) & (kv_idx < end)


def test_golden_causal():
    lowered = lowered_of(causal_mask, "mask_mod")
    assert lowered.lines == ()
    assert lowered.result == "q_idx >= kv_idx"
    assert lowered.kernel_params == ()


def test_golden_alibi():
    lowered = lowered_of(generate_alibi_bias(4))
    assert lowered.lines == ()
    assert lowered.result == "qk + tl.load(sm_slopes_ptr + off_hq * sm_slopes_stride0) * (kv_idx - q_idx).to(tl.float32)"
    assert lowered.kernel_params == ("sm_slopes_ptr", "sm_slopes_stride0")


def test_golden_gather_strides():
    lowered = lowered_of(bias_2d)
    assert lowered.kernel_params == ("sm_BIAS_ptr", "sm_BIAS_stride0", "sm_BIAS_stride1")
    assert lowered.result == (
        "qk + tl.load(sm_BIAS_ptr + (off_hq * sm_BIAS_stride0 + (q_idx - kv_idx + 31) * sm_BIAS_stride1))"
    )


def test_golden_gather_of_gather_names_the_shared_load():
    lowered = lowered_of(interval_mask, "mask_mod", prefix="mm_")
    # DOC's values are data, so the row they pick is not provably in range: it is wrapped (torch reads
    # intervals[-1] as the last row) and checked once, and both reads of that row share the check.
    assert lowered.lines == (
        "mm_t0 = tl.load(mm_DOC_ptr + q_idx * mm_DOC_stride0)",
        "mm_t1 = tl.where(mm_t0 < 0, mm_t0 + 4, mm_t0)",
        "mm_t2 = (mm_t1 >= 0) & (mm_t1 < 4)",
        "mm_t3 = tl.where(mm_t2, mm_t1, 0)",
    )
    assert lowered.result == (
        "(kv_idx.to(tl.int64) >= tl.where(mm_t2, tl.load(mm_INTERVALS_ptr + mm_t3 * mm_INTERVALS_stride0), 0)) & "
        "(kv_idx.to(tl.int64) < tl.where(mm_t2, tl.load(mm_INTERVALS_ptr + (mm_t3 * mm_INTERVALS_stride0 + "
        "mm_INTERVALS_stride1)), 0))"
    )
    # one parameter group per captured input, constants included (their value is written inline)
    names = [c.name for c in lowered.captured]
    assert names[:2] == ["DOC", "INTERVALS"]
    assert lowered.kernel_params[:5] == (
        "mm_DOC_ptr", "mm_DOC_stride0", "mm_INTERVALS_ptr", "mm_INTERVALS_stride0", "mm_INTERVALS_stride1"
    )  # fmt: skip


def test_golden_sympy_simplifies_index_arithmetic():
    lowered = lowered_of(lambda b, h, q, kv: q - kv + 255 - 255 >= 0, "mask_mod")
    assert lowered.result == "q_idx - kv_idx >= 0"
    lowered = lowered_of(lambda b, h, q, kv: (q * 4 + 8) // 4 - 2 == kv, "mask_mod")
    assert lowered.result == "q_idx == kv_idx"
    lowered = lowered_of(lambda b, h, q, kv: 2 - q < kv, "mask_mod")
    assert lowered.result == "2 - q_idx < kv_idx"


def test_golden_python_floor_division_and_remainder():
    lowered = lowered_of(lambda b, h, q, kv: (q - kv) // 3 == (q - kv) % 5, "mask_mod")
    assert lowered.lines == ("sm_t0 = q_idx - kv_idx",)
    assert lowered.result == "py_floordiv(sm_t0, 3) == py_remainder(sm_t0, 5)"


def test_golden_sliding_window_parenthesises_comparisons():
    # The window is a number the mod reads: the kernel's argument sm_window (trace/numbers.py).
    lowered = lowered_of(CATALOGUE["sliding_window"].build(1, 1, 64, 64, "cpu")[1], "mask_mod")
    assert lowered.result == "(q_idx >= 0) & (q_idx >= kv_idx) & (q_idx - kv_idx <= sm_window)"
    assert lowered.number_params == ("sm_window",) and lowered.kernel_params == ("sm_window",)


def test_golden_tanh_precise_and_approx():
    softcap = CATALOGUE["softcap"].build(1, 1, 16, 16, "cpu")[0]
    assert lowered_of(softcap).result == "precise_tanh(qk * tl.math.div_rn(1.0, sm_cap)) * sm_cap"
    assert lowered_of(softcap, tanh_approx=True).result == "tanh_approx(qk * tl.math.div_rn(1.0, sm_cap)) * sm_cap"


def test_golden_division_by_a_number_argument_multiplies_by_its_reciprocal():
    # [Note] Dividing by a number argument (lowering/ops.py): one reciprocal of the scalar, then a
    # multiply per element, as the compiler makes of a literal divisor; tensors and literals divide.
    cap, scale = 30.0, torch.tensor(2.0)
    assert lowered_of(lambda s, b, h, q, kv: s / cap).result == "qk * tl.math.div_rn(1.0, sm_cap)"
    assert lowered_of(lambda s, b, h, q, kv: (s + 1.0) / cap).result == "(qk + 1.0) * tl.math.div_rn(1.0, sm_cap)"
    assert "div_rn" not in lowered_of(lambda s, b, h, q, kv: cap / s).result  # a number divided by the score
    assert lowered_of(lambda s, b, h, q, kv: s / 30.0).result == "qk / 30.0"
    assert " / " in lowered_of(lambda s, b, h, q, kv: s / scale).result


def test_golden_literals_stay_constants():
    # A number written in the mod's code cannot change without new code: a constant of the kernel.
    assert lowered_of(lambda s, b, h, q, kv: torch.tanh(s / 20.0) * 20.0).result == "precise_tanh(qk / 20.0) * 20.0"


def test_golden_names_follow_inputs_and_prefix():
    inputs = ModInputs(score="s", b="bz", h="hq", q_idx="m", kv_idx="n")
    traced = trace_mod(alibi_like, "score_mod")[0]
    lowered = lower(traced, inputs, prefix="x_", variant=lowering_variant(traced, GOLDEN_BOUNDS))
    assert lowered.result == "s + tl.load(x_SLOPES_ptr + hq * x_SLOPES_stride0) * (n - m).to(tl.float32)"


def test_golden_casts_and_constants():
    assert lowered_of(lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf"))).result == (
        'tl.where(q_idx >= kv_idx, qk, float("-inf"))'
    )
    assert lowered_of(lambda s, b, h, q, kv: s + q.half()).result == "qk + q_idx.to(tl.float16).to(tl.float32)"
    assert lowered_of(lambda s, b, h, q, kv: s * torch.tensor(2.0) + 1).result == "qk * 2.0 + 1.0"
    assert lowered_of(lambda s, b, h, q, kv: s * SCALE).result == "qk * tl.load(sm_SCALE_ptr)"
    assert lowered_of(lambda s, b, h, q, kv: torch.full((), 1.5)).result == "tl.full([1, 1], 1.5, tl.float32)"
    assert lowered_of(lambda s, b, h, q, kv: s + KEEP[kv]).result == (
        "qk + (tl.load(sm_KEEP_ptr + kv_idx * sm_KEEP_stride0) != 0).to(tl.float32)"
    )


def test_golden_values_used_twice_are_named_once():
    def mod(score, b, h, q_idx, kv_idx):
        x = score * 2
        return x + x * x

    lowered = lowered_of(mod)
    assert lowered.lines == ("sm_t0 = qk * 2.0",)
    assert lowered.result == "sm_t0 + sm_t0 * sm_t0"


# -- numerical checks: every entry of the table --------------------------------------------------

NAN = float("nan")

SCORE_MODS = {
    # arithmetic
    "add_sub_mul_div": lambda s, b, h, q, kv: s * 2 + 1 - 0.5 / (s.abs() + 1),
    "int_true_division": lambda s, b, h, q, kv: s + q / (kv + 1),
    "add_sub_alpha": lambda s, b, h, q, kv: torch.add(s, q, alpha=2) + torch.sub(kv, q, alpha=3),
    "rsub": lambda s, b, h, q, kv: 1 - s + (2 - q) + torch.rsub(s, kv, alpha=2),
    "neg": lambda s, b, h, q, kv: -s + (-(q - kv)),
    "reciprocal_square": lambda s, b, h, q, kv: torch.reciprocal(s.abs() + 1) + torch.square(s) + torch.square(q - kv),
    "int_mul_chain": lambda s, b, h, q, kv: s + (q * 3 - kv * 2) * (h + 1) - b,
    # PyTorch's floor division and remainder on negative numbers
    "int_floordiv": lambda s, b, h, q, kv: s + (q - kv) // 3 + (q - kv) // -4 + (kv - q) // (q + 1),
    "int_remainder": lambda s, b, h, q, kv: s + (q - kv) % 5 + (q - kv) % -3 + torch.remainder(kv - q, q + 1),
    "int_fmod": lambda s, b, h, q, kv: s + torch.fmod(q - kv, 3) + torch.fmod(q - kv, -4),
    "int_div_modes": lambda s, b, h, q, kv: (
        s + torch.div(q - kv, 3, rounding_mode="trunc") + torch.div(q - kv, 3, rounding_mode="floor")
    ),
    "float_floordiv": lambda s, b, h, q, kv: s // 0.7 + s // -1.3 + torch.floor_divide(s, s.abs() + 0.5),
    "float_remainder_fmod": lambda s, b, h, q, kv: torch.remainder(s, 1.3) + torch.remainder(s, -0.9) + torch.fmod(s, 1.3),
    "float_div_modes": lambda s, b, h, q, kv: (
        torch.div(s, 0.7, rounding_mode="trunc") + torch.div(s, 0.7, rounding_mode="floor")
    ),
    # comparisons (Tensor and Scalar overloads) feeding arithmetic
    "comparisons": lambda s, b, h, q, kv: (
        s + (s > 0) + (s >= 0.5) * 2 + (q == kv) * 3 + (q != kv) * 5 + (s < q) * 7 + (kv <= 12) * 11 + (q - kv > -3) * 13
    ),
    "where": lambda s, b, h, q, kv: torch.where(q >= kv, s, -1e4) + torch.where(s > 0, 1.0, q - kv),
    "bitwise_ints": lambda s, b, h, q, kv: s + ((q & 5) ^ (kv | 2)) + ~q + torch.bitwise_and(kv, 6),
    # float functions
    "exp_log": lambda s, b, h, q, kv: torch.exp(s / 4) + torch.exp2(s / 4) + torch.log(s.abs() + 1) + torch.log2(s.abs() + 1),
    "sqrt_rsqrt": lambda s, b, h, q, kv: torch.sqrt(s.abs()) + torch.rsqrt(s.abs() + 0.1),
    "sin_cos_sigmoid": lambda s, b, h, q, kv: torch.sin(s) + torch.cos(s) + torch.sigmoid(s),
    "tanh": lambda s, b, h, q, kv: torch.tanh(s) + torch.tanh(s * 1e-3) * 1e3 + torch.tanh(s * 40),
    "tanh_of_int": lambda s, b, h, q, kv: s + torch.tanh(q - kv),
    "abs": lambda s, b, h, q, kv: s.abs() + (q - kv).abs(),
    "erf_floor_ceil": lambda s, b, h, q, kv: torch.erf(s) + torch.floor(s) + torch.ceil(s) + torch.floor(q - kv),
    "pow_small_exponents": lambda s, b, h, q, kv: (
        s**2 + s**3 + s.abs() ** 0.5 + (s.abs() + 1) ** -1 + (s.abs() + 1) ** -2 + (s.abs() + 1) ** -0.5 + s**1 + s**0
    ),
    "pow_general": lambda s, b, h, q, kv: (s.abs() + 0.5) ** 2.5 + s**5 + 2**s + 3.0**s + (s.abs() + 1) ** (s / 4),
    "pow_negative_base": lambda s, b, h, q, kv: torch.pow(s, torch.floor(s)) + (q - kv) ** 2,
    "pow_int_to_float": lambda s, b, h, q, kv: s + (q + 1) ** 0.5,
    # min / max / clamp, NaN propagation included
    "min_max": lambda s, b, h, q, kv: torch.minimum(s, s * 0.5) + torch.maximum(s, q - kv) + torch.maximum(q, kv),
    "clamp": lambda s, b, h, q, kv: (
        s.clamp(-1, 1) + s.clamp_min(0) + s.clamp_max(0.5) + torch.clamp(q - kv, max=3) + torch.clamp(q - kv, -2, 2)
    ),
    "clamp_tensor_bounds": lambda s, b, h, q, kv: torch.clamp(s, min=-(q + 1.0) / 4, max=(kv + 1.0) / 4),
    "nan_propagation": lambda s, b, h, q, kv: (
        torch.maximum(torch.where(q == kv, NAN, s), s) + torch.minimum(s, torch.where(q == kv + 1, NAN, s)) + s.clamp(-1, 1)
    ),
    # casts
    "casts_to_float": lambda s, b, h, q, kv: s + q.half() + kv.bfloat16() + (q * 100).float() + kv.double(),
    "casts_round": lambda s, b, h, q, kv: (s * 100.123).half() + (s * 1000.77).bfloat16() + s.to(torch.int32) + s.long(),
    "casts_bool": lambda s, b, h, q, kv: s + (q > kv).float() + (q - 5).bool() + (s > 0).int(),
    "casts_int": lambda s, b, h, q, kv: s + (q * 1000).to(torch.int16) + (q - kv).to(torch.int8) + q.long(),
    # constants
    "constants": lambda s, b, h, q, kv: (
        s * torch.tensor(2.0) + torch.full((), 3.0) + torch.ones_like(s) + torch.zeros_like(q) + torch.tensor(7)
    ),
    "identity_views": lambda s, b, h, q, kv: s.detach().clone() + q.clone(),
    "explicit_ops": lambda s, b, h, q, kv: (  # ops make_fx keeps when a mod calls them by name
        torch.ops.prims.convert_element_type.default(q, torch.float32) + torch.ops.aten.alias.default(s)
        + torch.full_like(s, 2.5) + torch.ops.aten.to.dtype(kv, torch.float16)
    ),
    # b and h
    "batch_and_head": lambda s, b, h, q, kv: s + b * 100 + h * 10 + (h // 2) - (b % 2),
    # reads of captured tensors
    "gather_1d": alibi_like,
    "gather_2d": bias_2d,
    "gather_2d_transposed": lambda s, b, h, q, kv: s + BIAS_T[h, q - kv + 31],
    "gather_3d_select_then_index": lambda s, b, h, q, kv: s + TABLE3[h][q, kv] + TABLE3[h][q][kv + 1],
    "gather_negative_constant_index": lambda s, b, h, q, kv: s + BIAS[-1, q] + BIAS[h, -2],
    "gather_of_gather": lambda s, b, h, q, kv: s + INTERVALS[DOC[kv]][0] - INTERVALS[DOC[q], 1],
    "gather_index_of_partial": lambda s, b, h, q, kv: s + INTERVALS[DOC[kv]][torch.tensor(1)],
    "gather_by_int8_values": lambda s, b, h, q, kv: s + BIAS[SMALL8[q].int(), kv] + BIAS[h, SMALL8[kv] + q],
    "int64_capture": lambda s, b, h, q, kv: s + ((q + OFFSETS64[h]) % 7) + (OFFSETS64[h] > 2**32),
    "bool_capture": lambda s, b, h, q, kv: torch.where(KEEP[kv], s, -s) + KEEP[q],
    "fp16_bf16_f64_captures": lambda s, b, h, q, kv: s * HALF[kv] + BF16[q] + F64[q + kv],
    "scalar_capture": lambda s, b, h, q, kv: s * SCALE,
    "cast_whole_capture": lambda s, b, h, q, kv: (
        s + DOC.float()[q] + KEEP.to(torch.int32)[kv] + BIAS.half().float()[h, q] + BIAS.bfloat16()[h, kv]
    ),
}

MASK_MODS = {
    "logical_ops": lambda b, h, q, kv: (
        torch.logical_and(q > 2, kv < 14) | torch.logical_or(q == kv, kv == 0) ^ torch.logical_not(q < kv)
    ),
    "logical_on_ints": lambda b, h, q, kv: torch.logical_xor(q - kv, kv % 3) & torch.logical_not(q % 4),
    "bitwise_on_bools": lambda b, h, q, kv: ((q >= kv) & ~(q == kv + 2)) | ((q % 3 == 0) ^ (kv % 2 == 0)),
    "bool_capture": lambda b, h, q, kv: KEEP[kv] & ~KEEP[q],
    "intervals": interval_mask,
    "document": lambda b, h, q, kv: DOC[q] == DOC[kv],
    "constant_mask": lambda b, h, q, kv: torch.ones((), dtype=torch.bool),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mod_matches_torch(name):
    fn = SCORE_MODS[name]
    tolerance = dict(rtol=2e-4, atol=2e-4) if name.startswith(("pow", "tanh", "exp_log")) else {}
    check(fn, "score_mod", kv_start=3, **tolerance)
    check(fn, "score_mod", b=0, h=3, q_start=7, kv_start=0, **tolerance)


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mod_matches_torch(name):
    check(MASK_MODS[name], "mask_mod", kv_start=3)
    check(MASK_MODS[name], "mask_mod", q_start=16, kv_start=0)


@pytest.mark.parametrize("variant", list(CATALOGUE))
def test_catalogue_variant_matches_torch(variant):
    score_mod, mask_mod = CATALOGUE[variant].build(2, 4, 64, 64, "cpu")
    for q_start, kv_start in [(0, 0), (32, 0), (16, 48)]:
        where = dict(b=1, h=3, q_start=q_start, kv_start=kv_start, M=16, N=16)
        if score_mod is not None:
            check(score_mod, "score_mod", **where)
        if mask_mod is not None:
            check(mask_mod, "mask_mod", **where)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_helpers_on_edge_values():
    """precise_tanh, pow_float and the float division helpers on huge, tiny, zero and NaN inputs."""
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-7, 0.2499, 0.2501, -3.0, 9.5, 44.0, -1e30, float("inf"), NAN])
    score = torch.cat([values, values.flip(0), values * 0.5, values + 1]).reshape(4, 12).repeat(4, 1)[:16, :12]
    score = torch.nn.functional.pad(score, (0, 4))  # 16 x 16
    check(lambda s, b, h, q, kv: torch.tanh(s), score=score, rtol=2e-6, atol=1e-7)
    check(lambda s, b, h, q, kv: torch.pow(s, 3.0) + torch.pow(-2.0, s), score=score.clamp(-60, 60), rtol=2e-4, atol=0)
    check(lambda s, b, h, q, kv: torch.remainder(s, 2.5) + torch.fmod(s, -2.5), score=score.clamp(-1e6, 1e6))


# -- the rest of the contract --------------------------------------------------------------------

ALL_MODS = [(fn, "score_mod") for fn in SCORE_MODS.values()] + [(fn, "mask_mod") for fn in MASK_MODS.values()]


def test_every_body_parses():
    for fn, kind in ALL_MODS:
        for tanh_approx in (False, True):
            lowered = lowered_of(fn, kind, tanh_approx=tanh_approx)
            ast.parse(lowered.body + "\n__result = " + lowered.result)
            assert all(not line.startswith(" ") for line in lowered.lines)


def test_temporaries_and_params_carry_the_prefix():
    for fn, kind in ALL_MODS:
        lowered = lowered_of(fn, kind, prefix="mm_")
        assert all(line.startswith("mm_t") for line in lowered.lines)
        assert all(p.startswith("mm_") for p in lowered.kernel_params)
        expected = [
            p
            for c in lowered.captured
            for p in [f"mm_{c.name}_ptr"] + [f"mm_{c.name}_stride{d}" for d in range(len(c.shape))]
        ]
        assert list(lowered.kernel_params) == expected


def test_helpers_template_is_plain_python():
    source = _ENV.get_template("mod_helpers.py.jinja").render()
    tree = ast.parse(source)
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"py_floordiv", "py_remainder", "py_floordiv_float", "trunc_div", "pow_float", "precise_tanh",
            "tanh_approx", "round_to_bfloat16", "torch_maximum", "torch_minimum", "torch_shift_left",
            "torch_shift_right", "round_half_even", "trunc_float", "torch_sign", "torch_log1p", "torch_expm1",
            "gelu_erf", "gelu_tanh", "silu"} <= names  # fmt: skip


def test_register_lowering_adds_a_table_entry():
    op = torch.ops.aten.sinh
    assert op not in LOWERINGS and op.default not in LOWERINGS
    mod = lambda s, b, h, q, kv: torch.sinh(s / 4) * 2 + torch.sinh(q - kv)  # noqa: E731
    try:
        register_lowering(op, lambda x: f"(tl.exp({x}) - tl.exp(-{x})) * 0.5", inputs="result")
        lowered = lowered_of(mod)
        assert lowered.lines == ("sm_t0 = qk / 4.0", "sm_t1 = (q_idx - kv_idx).to(tl.float32)")
        assert lowered.result == "(tl.exp(sm_t0) - tl.exp(-sm_t0)) * 0.5 * 2.0 + (tl.exp(sm_t1) - tl.exp(-sm_t1)) * 0.5"
        check(mod)
    finally:
        LOWERINGS.pop(op, None)


def test_register_lowering_as_decorator_and_bad_arguments():
    op = torch.ops.aten.expm1.default
    try:

        @register_lowering(op)
        def _expm1(x):
            return f"tl.exp({x}) - 1.0"

        check(lambda s, b, h, q, kv: torch.expm1(s / 8), rtol=1e-4, atol=1e-5)
    finally:
        LOWERINGS.pop(op, None)
    with pytest.raises(TypeError, match="aten op"):
        register_lowering("expm1", lambda x: x)
    with pytest.raises(ValueError, match="inputs"):
        register_lowering(op, lambda x: x, inputs="float64")


def cumsum_mod(score, b, h, q_idx, kv_idx):
    return score + torch.cumsum(SLOPES, 0)[h]


def sort_mask(b, h, q_idx, kv_idx):
    return torch.sort(DOC).values[q_idx] >= kv_idx


def test_unsupported_op_names_op_mod_and_line():
    with pytest.raises(UnsupportedOpError) as info:
        lowered_of(cumsum_mod)
    message = str(info.value)
    assert "aten.cumsum.default" in message
    assert "score_mod 'cumsum_mod'" in message
    assert "test_lowering.py:" in message and "torch.cumsum(SLOPES, 0)[h]" in message
    assert "outside the mod" in message  # the fix
    assert "register_lowering(torch.ops.aten.cumsum" in message

    with pytest.raises(UnsupportedOpError) as info:
        lowered_of(sort_mask, "mask_mod")
    message = str(info.value)
    assert "aten.sort" in message and "mask_mod 'sort_mask'" in message and "torch.sort(DOC)" in message


def test_unsupported_usage_is_explained():
    with pytest.raises(UnsupportedOpError, match="Index captured tensors down to one element"):
        lowered_of(lambda s, b, h, q, kv: s + (BIAS * 2)[h, q])
    with pytest.raises(UnsupportedOpError, match="similar names: .*maximum|Instead use torch.maximum"):
        lowered_of(lambda s, b, h, q, kv: torch.fmax(s, s * 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_on_gpu():
    """The same checks with real Triton compilation (TRITON_INTERPRET=0), plus tanh.approx."""
    script = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import torch, test_lowering as t
assert os.environ["TRITON_INTERPRET"] == "0"
t.run_gpu_checks()
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


def run_gpu_checks():
    """Run every numerical case on CUDA tensors with compiled kernels (called by test_compiled_on_gpu)."""
    global run_kernel
    cpu_run_kernel = run_kernel

    def on_gpu(fn, kind, score, bounds=None, **kw):
        traced, captured = trace_mod(fn, kind)
        variant = lowering_variant(traced, bounds) if bounds is not None else None
        lowered = lower(traced, prefix="sm_" if kind == "score_mod" else "mm_",
                        tanh_approx=kw.pop("tanh_approx", False), variant=variant)  # fmt: skip
        mask = kind == "mask_mod"
        kernel = compile_kernel(render(lowered, mask))
        M, N = score.shape
        out = torch.empty(M, N, dtype=torch.int8 if mask else torch.float32, device="cuda")
        extra = [x for t in captured for x in ((t.cuda(), *t.stride()) if isinstance(t, torch.Tensor) else (t,))]
        kernel[(1,)](out, score.cuda(), kw["b"], kw["h"], kw["q_start"], kw["kv_start"], *extra, BLOCK_M=M, BLOCK_N=N)
        return (out.bool() if mask else out).cpu()

    run_kernel = on_gpu
    failures = []
    try:
        for name, fn in SCORE_MODS.items():
            try:
                loose = name.startswith(("pow", "tanh", "exp_log", "sin", "sqrt", "float_floordiv", "float_div"))
                check(fn, "score_mod", kv_start=3, **(dict(rtol=1e-3, atol=1e-3) if loose else {}))
            except Exception as err:  # collect all, report together
                failures.append(f"{name}: {str(err)[:300]}")
        for name, fn in MASK_MODS.items():
            try:
                check(fn, "mask_mod", kv_start=3)
            except Exception as err:
                failures.append(f"{name}: {str(err)[:300]}")
        # the ops and dtype rules of test_lowering_ops.py / test_lowering_types.py, compiled
        import test_lowering_ops as ops_cases
        import test_lowering_types as type_cases

        extra = {
            **{f"ops.{k}": (fn, "score_mod") for k, fn in ops_cases.SCORE_MODS.items()},
            **{f"ops.{k}": (fn, "mask_mod") for k, fn in ops_cases.MASK_MODS.items()},
            "types.small_overflow": (type_cases.small_overflow_mask, "mask_mod"),
            "types.relative_bias": (type_cases.relative_bias, "score_mod"),
            "types.bool_add": (lambda s, b, h, q, kv: s + ((q >= kv) + (kv >= 0)) * 1.0, "score_mod"),
            "types.int64_constant": (lambda s, b, h, q, kv: s + ((q + 2**33) % 7) + (kv < 2**33), "score_mod"),
        }
        for name, (fn, kind) in extra.items():
            try:
                check(fn, kind, h=3, kv_start=3, **(dict(rtol=1e-3, atol=1e-3) if kind == "score_mod" else {}))
            except Exception as err:
                failures.append(f"{name}: {str(err)[:300]}")
        test_helpers_on_edge_values()
        softcap = CATALOGUE["softcap"].build(1, 1, 16, 16, "cpu")[0]
        score = torch.randn(16, 16) * 30
        approx = on_gpu(softcap, "score_mod", score, b=0, h=0, q_start=0, kv_start=0, tanh_approx=True)
        torch.testing.assert_close(approx, softcap(score, 0, 0, 0, 0), rtol=2e-3, atol=2e-3)
    finally:
        run_kernel = cpu_run_kernel
    assert not failures, "\n".join(failures)
    print("gpu checks passed")
