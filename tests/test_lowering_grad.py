"""The score_mod gradient lowering (flexattn/lowering/gradient.py), run through Triton's interpreter.

A small kernel around ``score_mod_backward`` (shaped as the backward kernels' template pastes it)
loads random ``qk`` and ``grad`` tiles and a random ``grad_keep``, calls the lowered gradient in both
tile layouts (``Q_AXIS`` 0: [queries, keys]; 1: [keys, queries]) and stores d score; the learnable
captured tensors' gradients land in float32 buffers. Both are compared with torch.autograd over the
mod itself, vmapped over the same index grid in float64.
"""

import os
import pathlib
import re

import jinja2
import pytest
import torch

from flexattn.codegen import load_kernel_module
from flexattn.errors import UnsupportedOpError
from flexattn.lowering import IndexBounds, LoweredScoreGrad, lower, lower_score_grad, lowering_variant
from flexattn.trace import GetItemToIndex, trace_mod
from numerics import rel_err

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "flexattn" / "templates"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

HARNESS = """\
import triton
import triton.language as tl

{% include "mod_helpers.py.jinja" %}


@triton.jit
def score_mod_backward(qk, grad, off_z, off_hq, q_idx, kv_idx, grad_keep, ACCUMULATE: tl.constexpr, Q_AXIS: tl.constexpr,
                       DETERMINISTIC: tl.constexpr, {%- for p in params %} {{ p }},{% endfor %}):
{{ body | indent(4, first=True) }}
    if ACCUMULATE:
{{ accumulate | indent(8, first=True) }}
    return {{ result }}


@triton.jit
def grad_kernel(
    dscore_ptr, qk_ptr, grad_ptr, keep_ptr, b, h, q_start, kv_start,
    {%- for p in params %} {{ p }},{% endfor %}
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_AXIS: tl.constexpr, DETERMINISTIC: tl.constexpr = False,
):
    off_z = tl.full([], b, tl.int32)
    off_hq = tl.full([], h, tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # Memory holds [queries, keys] row-major; the tile is read in the layout under test.
    if Q_AXIS == 0:
        q_idx = (q_start + offs_m)[:, None]
        kv_idx = (kv_start + offs_n)[None, :]
        tile = offs_m[:, None] * BLOCK_N + offs_n[None, :]
    else:
        q_idx = (q_start + offs_m)[None, :]
        kv_idx = (kv_start + offs_n)[:, None]
        tile = offs_m[None, :] * BLOCK_N + offs_n[:, None]
    qk = tl.load(qk_ptr + tile)
    grad = tl.load(grad_ptr + tile)
    grad_keep = tl.load(keep_ptr + tile) != 0
    dscore = score_mod_backward(qk, grad, off_z, off_hq, q_idx, kv_idx, grad_keep, True, Q_AXIS, DETERMINISTIC,
                                {%- for p in params %} {{ p }},{% endfor %})
    tl.store(dscore_ptr + tile, tl.broadcast_to(dscore, tile.shape))
"""

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined)


def render(lowered: LoweredScoreGrad) -> str:
    return _ENV.from_string(HARNESS).render(
        params=lowered.kernel_params, body=lowered.body or "pass", result=lowered.result,
        accumulate="\n".join(lowered.accumulate) or "pass",
    )  # fmt: skip


def run_lowered(build, tensors, *, b, h, q_start, kv_start, qk, grad, keep, q_axis, bounds=None, deterministic=False,
                **options):
    """d score and the learnable tensors' gradients, from the lowered gradient in a Triton kernel
    (``deterministic``: the deterministic backward's accumulation, a tile sum per element)."""
    if not INTERPRETED:
        pytest.skip("needs a process started with TRITON_INTERPRET=1")
    traced, captured = trace_mod(build(tensors), "score_mod")
    variant = lowering_variant(traced, bounds) if bounds is not None else None
    lowered = lower_score_grad(traced, variant=variant, **options)
    kernel = load_kernel_module(render(lowered), "test_grad").grad_kernel
    M, N = qk.shape
    dscore = torch.full((M, N), float("nan"))
    buffers = {i: torch.zeros(captured[i].shape, dtype=torch.float32) for i in lowered.trainable}
    extra = [x for t in captured for x in ((t, *t.stride()) if isinstance(t, torch.Tensor) else (t,))] + [buffers[i] for i in lowered.trainable]
    kernel[(1,)](dscore, qk, grad, keep.to(torch.int8), b, h, q_start, kv_start, *extra,
                 BLOCK_M=M, BLOCK_N=N, Q_AXIS=q_axis, DETERMINISTIC=deterministic)  # fmt: skip
    # Named as in ``tensors`` (the traced names say where the tensor was found: "t_slopes").
    names = {next(k for k, v in tensors.items() if v is captured[i]): buffers[i] for i in lowered.trainable}
    return dscore, names, lowered


def run_torch(build, tensors, *, b, h, q_start, kv_start, qk, grad, keep):
    """The same gradients from torch.autograd over the mod in float64, evaluated (torch.vmap) at the
    pairs that count only: a pair that does not count adds nothing, even where the mod's derivative
    is infinite there."""
    leaves = {k: v.detach().double().requires_grad_(v.requires_grad) if v.is_floating_point() else v
              for k, v in tensors.items()}  # fmt: skip
    score = qk.double().requires_grad_(True)
    fn = build(leaves)
    qi, ki = keep.nonzero(as_tuple=True)
    b_, h_ = torch.tensor(b, dtype=torch.int32), torch.tensor(h, dtype=torch.int32)

    def one(s, q_idx, kv_idx):
        return fn(s, b_, h_, q_idx, kv_idx)

    with GetItemToIndex():
        out = torch.vmap(one)(score[qi, ki], (qi + q_start).int(), (ki + kv_start).int())
    wanted = [score] + [leaves[k] for k in leaves if leaves[k].requires_grad]
    grads = torch.autograd.grad(out, wanted, grad.double()[qi, ki].expand_as(out), allow_unused=True,
                                materialize_grads=True)  # fmt: skip
    learnable = [k for k in leaves if leaves[k].requires_grad]
    return grads[0], dict(zip(learnable, grads[1:]))


def check(build, tensors, *, b=1, h=2, q_start=3, kv_start=0, M=16, N=32, tol=1e-5, bounds="both", **options):
    """The lowered gradient matches torch's in both layouts, lowered for any lengths and for the tile's."""
    qk = torch.randn(M, N) * 3
    grad = torch.randn(M, N)
    keep = torch.rand(M, N) > 0.25
    grad = torch.where(keep, grad, 0.0)  # the kernels pass 0 where a pair does not count
    where = dict(b=b, h=h, q_start=q_start, kv_start=kv_start, qk=qk, grad=grad, keep=keep)
    want_ds, want = run_torch(build, tensors, **where)
    tile = IndexBounds(B=b + 1, H=h + 1, Q_LEN=q_start + M, KV_LEN=kv_start + N)
    lowered = None
    for lowered_for in {"both": (None, tile), "any": (None,), "tile": (tile,)}[bounds]:
        for q_axis in (0, 1):
            ds, got, lowered = run_lowered(build, tensors, **where, q_axis=q_axis, bounds=lowered_for, **options)
            context = f"(Q_AXIS={q_axis}, bounds={lowered_for})"
            assert rel_err(ds, want_ds) < tol, f"d score {context}: {rel_err(ds, want_ds)}"
            assert set(got) == set(want), context
            for name in want:
                err = rel_err(got[name], want[name].float())
                assert err < tol, f"d {name} {context}: {err}\n{got[name]}\n{want[name]}"
    return lowered


def learnable(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).requires_grad_(True)


# -- cases -------------------------------------------------------------------------------------------


def test_identity(one_thread):
    lowered = check(lambda t: (lambda score, b, h, q_idx, kv_idx: score), {})
    assert lowered.accumulate == () and lowered.trainable == ()


def test_alibi_learnable_slopes(one_thread):
    def build(t):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + t["slopes"][h] * (kv_idx - q_idx)

        return alibi

    lowered = check(build, {"slopes": learnable(4)})
    assert lowered.kernel_params[-1] == "sm_t_slopes_grad_ptr" and lowered.trainable == (0,)
    assert lowered.accumulate[0].endswith(", 0, Q_AXIS, DETERMINISTIC)"), lowered.accumulate  # one atomic per tile


def test_relative_bias_per_element(one_thread):
    def build(t):
        def rel(score, b, h, q_idx, kv_idx):
            return score + t["bias"][h, q_idx - kv_idx + 40]

        return rel

    lowered = check(build, {"bias": learnable(4, 80)})
    assert lowered.accumulate[0].startswith("accumulate_captured_grad_pairs(sm_t_bias_grad_ptr, "), lowered.accumulate


def test_negative_indices_wrap(one_thread):
    # Indices from -24 to 23 on a table of 24: torch reads bias[-k] as bias[24 - k], and so must the
    # gradient's address (lowered for any lengths the index is also masked).
    bias = learnable(24)

    def build(t):
        def rel(score, b, h, q_idx, kv_idx):
            i = q_idx - kv_idx
            return score * t["bias"][i.clamp(-24, 23)]

        return rel

    check(build, {"bias": bias})


def test_per_query_and_per_key_tables(one_thread):
    def build(t):
        def mod(score, b, h, q_idx, kv_idx):
            return score * t["tq"][q_idx] + t["tk"][kv_idx]

        return mod

    lowered = check(build, {"tq": learnable(32), "tk": learnable(40)})
    depends = sorted(line.rsplit(", ", 3)[1] for line in lowered.accumulate)
    assert depends == ["1", "2"], lowered.accumulate


def _deterministic_cases():
    """Address patterns for the deterministic accumulation: one element, per query and per key with
    two rows (columns) meeting at an element, per pair with many meeting, a few buckets."""
    dist = torch.randint(0, 10, (19, 40), dtype=torch.int32)
    return {
        "per_head": (lambda t: lambda score, b, h, q_idx, kv_idx: score + t["w"][h] * (kv_idx - q_idx),
                     {"w": learnable(4)}),
        "halved_rows": (lambda t: lambda score, b, h, q_idx, kv_idx: score * t["tq"][q_idx // 2] + t["tk"][kv_idx // 3],
                        {"tq": learnable(16), "tk": learnable(14)}),
        "relative": (lambda t: lambda score, b, h, q_idx, kv_idx: score + t["bias"][h, q_idx - kv_idx + 40],
                     {"bias": learnable(4, 80)}),
        "buckets": (lambda t: lambda score, b, h, q_idx, kv_idx: score + t["bias"][t["dist"][q_idx, kv_idx]],
                    {"bias": learnable(10), "dist": dist}),
    }


@pytest.mark.parametrize("case", ["per_head", "halved_rows", "relative", "buckets"])
def test_deterministic_accumulation(one_thread, case):
    # The deterministic backward sums a tile per distinct element (no two atomics of one instruction
    # meet); the gradients are the same sums.
    build, tensors = _deterministic_cases()[case]
    check(build, tensors, bounds="any", deterministic=True)


def test_soft_cap_exact(one_thread):
    def build(t):
        def softcap(score, b, h, q_idx, kv_idx):
            return t["cap"][h] * torch.tanh(score / t["cap"][h])

        return softcap

    check(build, {"cap": (torch.rand(4) * 10 + 5).requires_grad_(True)})


def test_soft_cap_constant_and_approx_tanh_option(one_thread):
    def build(t):
        def softcap(score, b, h, q_idx, kv_idx):
            return 20.0 * torch.tanh(score / 20.0)

        return softcap

    check(build, {})
    traced, _ = trace_mod(build({}), "score_mod")
    exact, approx = lower_score_grad(traced), lower_score_grad(traced, tanh_approx=True)
    assert "precise_tanh" in exact.body and "tanh_approx(" in approx.body and "precise_tanh" not in approx.body


def test_learnable_tensor_read_twice(one_thread):
    def build(t):
        def mod(score, b, h, q_idx, kv_idx):
            return t["w"][h] * score + t["w"][h + 1]

        return mod

    check(build, {"w": learnable(4)})


def test_graphormer_bias_through_int_table(one_thread):
    dist = torch.randint(0, 10, (19, 40), dtype=torch.int32)

    def build(t):
        def graphormer(score, b, h, q_idx, kv_idx):
            return score + t["bias"][t["dist"][q_idx, kv_idx]]

        return graphormer

    check(build, {"bias": learnable(10), "dist": dist})


def test_mod_ignoring_the_score(one_thread):
    def build(t):
        def bias_only(score, b, h, q_idx, kv_idx):
            return t["bias"][h, q_idx]

        return bias_only

    lowered = check(build, {"bias": learnable(4, 20)})
    assert lowered.result == "tl.full([1, 1], 0.0, tl.float32)"


def test_where_masking_inside_a_score_mod(one_thread):
    def build(t):
        def causal(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score * t["s"][0], -float("inf"))

        return causal

    check(build, {"s": learnable(2)})


@pytest.mark.parametrize(
    "name", ["exp", "log", "sigmoid", "abs", "clamp", "pow", "div", "sqrt_relu_maximum", "gelu_softplus"]
)
def test_elementwise_derivatives(one_thread, name):
    bodies = {
        "exp": lambda s, w, q, kv: torch.exp(s * 0.25) * w,
        "log": lambda s, w, q, kv: torch.log(s.abs() + w.abs() + 0.5),
        "sigmoid": lambda s, w, q, kv: torch.sigmoid(s * w),
        "abs": lambda s, w, q, kv: s.abs() * w - (s - w).abs(),
        "clamp": lambda s, w, q, kv: torch.clamp(s * w, -1.5, 2.0) + s.clamp(min=w),
        "pow": lambda s, w, q, kv: s**2 * 0.5 + (s.abs() + 1) ** w + torch.pow(s, 3) * 0.1,
        "div": lambda s, w, q, kv: s / (w.abs() + 1) + 1.0 / (s.abs() + 1) + s / (q - kv + 0.5),
        "sqrt_relu_maximum": lambda s, w, q, kv: torch.sqrt(s.abs() + 1) + torch.relu(s - w) + torch.maximum(s, w),
        "gelu_softplus": lambda s, w, q, kv: torch.nn.functional.gelu(s) * w + torch.nn.functional.softplus(s * w),
    }
    body = bodies[name]

    def build(t):
        def mod(score, b, h, q_idx, kv_idx):
            # w per key, not per head: TRITON_INTERPRET=1 (Triton 3.9) types a comparison of two
            # scalars (w >= 0 in pow's derivative) float32, and `&` with it then fails.
            return body(score, t["w"][kv_idx % 4], q_idx, kv_idx)

        mod.__name__ = name
        return mod

    check(build, {"w": learnable(4)}, tol=1e-5)


def test_bf16_learnable_tensor(one_thread):
    def build(t):
        def mod(score, b, h, q_idx, kv_idx):
            return score * t["w"][h].float() + t["u"][q_idx]

        return mod

    check(build, {"w": learnable(4, dtype=torch.bfloat16), "u": learnable(32, dtype=torch.bfloat16)})


def test_non_contiguous_learnable_tensor(one_thread):
    base = torch.randn(40, 4)
    bias_t = base.t().requires_grad_(True)  # shape (4, 40), strides (1, 4): a leaf built from a view
    assert not bias_t.is_contiguous()

    def build(t):
        def rel(score, b, h, q_idx, kv_idx):
            return score + t["bias"][h, kv_idx]

        return rel

    check(build, {"bias": bias_t})


def test_unsupported_gradient_names_op_line_and_fallback():
    emb = learnable(40, 8)

    def dot_mod(score, b, h, q_idx, kv_idx):
        return score + torch.dot(emb[q_idx], emb[kv_idx])  # the learnable rows read as vectors

    traced, _ = trace_mod(dot_mod, "score_mod")
    lower(traced)  # the forward lowers
    with pytest.raises(UnsupportedOpError) as info:
        lower_score_grad(traced)
    message = str(info.value)
    assert "gradient of score_mod 'dot_mod'" in message and "'emb'" in message
    assert "torch.dot(emb[q_idx], emb[kv_idx])" in message  # the user's line
    assert 'kernel_options={"BACKEND": "PYTORCH"}' in message


def test_unsupported_derivative_op_names_forward_op(one_thread):
    # A derivative whose ops have no lowering: the error names the forward op and the user's line.
    from flexattn.lowering import LOWERINGS

    def mod(score, b, h, q_idx, kv_idx):
        return torch.sin(score) * 2.0  # sin's derivative is cos

    traced, _ = trace_mod(mod, "score_mod")
    saved = LOWERINGS.pop(torch.ops.aten.cos)
    try:
        with pytest.raises(UnsupportedOpError) as info:
            lower_score_grad(traced)
    finally:
        LOWERINGS[torch.ops.aten.cos] = saved
    message = str(info.value)
    assert "aten.cos" in message and "derivative of aten.sin" in message
    assert "torch.sin(score) * 2.0" in message and '"BACKEND": "PYTORCH"' in message


def test_same_source_for_same_graph():
    slopes = learnable(4)

    def alibi(score, b, h, q_idx, kv_idx):
        return torch.tanh(score) + slopes[h] * (kv_idx - q_idx)

    traced, _ = trace_mod(alibi, "score_mod")
    first, second = lower_score_grad(traced), lower_score_grad(traced)
    assert first == second
    forward = lower(traced, prefix="p_")
    assert lower_score_grad(traced, prefix="p_").kernel_params == forward.kernel_params + ("p_slopes_grad_ptr",)
    # Every name the lines and the accumulate calls use is a kernel name, a temporary or a parameter.
    names = set(re.findall(r"\b[A-Za-z_]\w*\b", " ".join(first.lines + first.accumulate + (first.result,))))
    allowed = {"tl", "qk", "grad", "grad_keep", "off_z", "off_hq", "q_idx", "kv_idx", "Q_AXIS", "DETERMINISTIC", "to",
               "where",
               "float32", "int64", "int32", "full", "precise_tanh", "accumulate_captured_grad"}  # fmt: skip
    assert {n for n in names if not n.startswith("sm_")} <= allowed, names


# The derivative is computed at every pair, the diagonal too, where it divides by zero: Triton's
# interpreter (NumPy) warns about it; that the pair then adds nothing is what this test checks.
@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered in:RuntimeWarning")
def test_pairs_that_do_not_count_add_nothing(one_thread):
    # On the diagonal the derivatives are infinite; the diagonal does not count there, so grad is 0 and
    # 0 * inf = NaN must reach neither d score nor the buffer.
    def build(t):
        def mod(score, b, h, q_idx, kv_idx):
            return score * t["w"][h] / (q_idx - kv_idx)

        return mod

    M = N = 16
    qk, grad = torch.randn(M, N), torch.randn(M, N)
    keep = (torch.rand(M, N) > 0.25) & ~torch.eye(M, dtype=torch.bool)
    grad = torch.where(keep, grad, 0.0)
    where = dict(b=0, h=1, q_start=0, kv_start=0, qk=qk, grad=grad, keep=keep)
    tensors = {"w": learnable(4)}
    want_ds, want = run_torch(build, tensors, **where)
    for q_axis in (0, 1):
        ds, got, _ = run_lowered(build, tensors, **where, q_axis=q_axis)
        assert rel_err(ds, want_ds) < 1e-5 and rel_err(got["w"], want["w"].float()) < 1e-5


def test_out_of_range_reads_add_nothing(one_thread):
    if not INTERPRETED:
        pytest.skip("needs a process started with TRITON_INTERPRET=1")
    # bias has 8 elements; q_idx - kv_idx runs from -31 to 15. torch reads bias[-k] as bias[8 - k] and
    # raises beyond; the kernel reads 0 there, so the gradient must go nowhere for those pairs (and
    # never outside the buffer: it sits inside a larger zeroed tensor that must stay zero).
    def rel(score, b, h, q_idx, kv_idx):
        return score + BIAS8[q_idx - kv_idx]

    BIAS8 = learnable(8)
    M, N = 16, 32
    qk, grad = torch.randn(M, N), torch.randn(M, N)
    keep = torch.rand(M, N) > 0.25
    grad = torch.where(keep, grad, 0.0)
    q = torch.arange(M)[:, None]
    kv = torch.arange(N)[None, :]
    rel_idx = (q - kv).expand(M, N)
    counts = keep & (rel_idx >= -8) & (rel_idx < 8)
    want = torch.zeros(8, dtype=torch.float64).index_add_(0, rel_idx[counts] % 8, grad.double()[counts])
    traced, captured = trace_mod(rel, "score_mod")
    lowered = lower_score_grad(traced)
    kernel = load_kernel_module(render(lowered), "test_grad").grad_kernel
    for q_axis in (0, 1):
        big = torch.zeros(64)
        buffer = big[24:32]
        ds = torch.full((M, N), float("nan"))
        kernel[(1,)](ds, qk, grad, keep.to(torch.int8), 0, 0, 0, 0, BIAS8, 1, buffer, BLOCK_M=M, BLOCK_N=N, Q_AXIS=q_axis)
        assert rel_err(buffer, want.float()) < 1e-5, (buffer, want)
        assert not big[:24].any() and not big[32:].any()
        assert torch.equal(ds, grad)


def test_attention_gym_approx_softcap(one_thread):
    # attention-gym's softcap(approx=True) calls its own op approx::tanh, which has no autograd formula
    # of its own: its derivative is tanh's (and with tanh_approx=True it reads the approximate value).
    mods = pytest.importorskip("attn_gym.mods")
    softcap = mods.generate_tanh_softcap(20.0, approx=True)
    check(lambda t: softcap, {})
    approx = lower_score_grad(trace_mod(softcap, "score_mod")[0], tanh_approx=True)
    assert "tanh_approx(" in approx.body and "precise_tanh" not in approx.body


def test_op_without_autograd_formula_is_refused():
    # A library op with a lowering but no derivative: refused, never a silent zero gradient.
    from flexattn.lowering import register_lowering

    if not hasattr(torch.ops, "flexattn_test") or not hasattr(torch.ops.flexattn_test, "twice"):
        torch.library.define("flexattn_test::twice", "(Tensor x) -> Tensor")
        torch.library.impl("flexattn_test::twice", "CompositeExplicitAutograd", lambda x: x * 2)
        torch.library.register_fake("flexattn_test::twice", lambda x: torch.empty_like(x))
    op = torch.ops.flexattn_test.twice
    register_lowering(op.default, lambda x: f"2.0 * {x}")

    def doubled(score, b, h, q_idx, kv_idx):
        return torch.ops.flexattn_test.twice(score)

    traced, _ = trace_mod(doubled, "score_mod")
    lower(traced)
    with pytest.raises(UnsupportedOpError, match="no autograd formula") as info:
        lower_score_grad(traced)
    assert "torch.ops.flexattn_test.twice(score)" in str(info.value)


def test_the_gradient_is_lowered_the_same_without_grad_mode(monkeypatch):
    # A compiled graph's backward lowers a mod's gradient with grad mode off; the derivatives must
    # not depend on it (they once came out as 0 there).
    import flexattn.lowering.gradient as gradient
    from flexattn.lowering import lower_score_grad
    from flexattn.trace import trace_mod

    slopes = torch.rand(4, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):
        return torch.tanh(score) * 2.0 + slopes[h] * (kv_idx - q_idx)

    traced, _ = trace_mod(bias, "score_mod")
    monkeypatch.setattr(gradient, "_vjp_cache", type(gradient._vjp_cache)())
    with torch.no_grad():
        without = lower_score_grad(traced)
    monkeypatch.setattr(gradient, "_vjp_cache", type(gradient._vjp_cache)())
    with_grad = lower_score_grad(traced)
    assert (without.lines, without.result, without.accumulate) == (with_grad.lines, with_grad.result,
                                                                   with_grad.accumulate)
    assert "0.0" != without.result.strip()
