"""flex_attention inside torch.compile (issue 21): no graph break at the call, fullgraph forward and
backward equal to eager, gradients to the tensors a mod reads, recompiles only where a graph must
change, and compiled results that follow new contents. CPU, PyTorch backend (the op runs the same
dispatch as an eager call; the GPU tests run the Triton kernels).

Most compiles use the "aot_eager" backend, which runs the op's fake implementation and its autograd
formula as Inductor does, in a fraction of Inductor's CPU compile time; one test runs Inductor.
"""

import gc
import weakref

import pytest
import torch
import torch._dynamo.testing
from numerics import rel_err

import flexattn
from flexattn import AuxRequest, BlockMask, create_block_mask, flex_attention
from flexattn.errors import InvalidInputError
from flexattn.variants import CATALOGUE

B, H, L, E = 1, 2, 128, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def qkv(L=L, S=L, requires_grad=False, Hkv=H):
    q = torch.randn(B, H, L, E, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, S, E, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, S, E, requires_grad=requires_grad)
    return q, k, v


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def counted(fn, backend="aot_eager", **kwargs):
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, **kwargs), counter


def grads(*tensors):
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def test_assume_constant_result_still_marks_functions_as_flexattn_does():
    # api.py sets the attribute itself (the decorator imports Dynamo, 1.7 s at import time).
    assert torch.compiler.assume_constant_result(lambda: 0)._dynamo_marked_constant is True


class Layer(torch.nn.Module):
    """A small attention layer: projections, a learnable per-head bias read by the score_mod."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(E, 3 * H * E)
        self.out = torch.nn.Linear(H * E, E)
        self.slopes = torch.nn.Parameter(torch.rand(H))

        def alibi(score, b, h, q_idx, kv_idx):
            return score + self.slopes[h] * (kv_idx - q_idx)

        self.score_mod = alibi

    def forward(self, x, block_mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, H, E).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], H * E))


def test_a_layer_compiles_without_graph_breaks():
    layer = Layer()
    x = torch.randn(B, L, E)
    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    explained = torch._dynamo.explain(layer)(x, bm)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_a_layer_trains_compiled_like_eager():
    layer = Layer()
    x = torch.randn(B, L, E, requires_grad=True)
    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    layer(x, bm).square().sum().backward()
    expected = grads(x, *layer.parameters())
    compiled, counter = counted(layer)
    out = compiled(x, bm)
    out.square().sum().backward()
    assert torch.allclose(out, layer(x, bm), atol=1e-5)
    for got, want in zip(grads(x, *layer.parameters()), expected):
        assert rel_err(got, want) < 1e-5
    assert counter.frame_count == 1


# Every entry: captured index tensors in masks (documents, NATTEN), Python numbers in closures
# (softcap, windows), learnable tables (T5, Graphormer, head temperature), sinks through the LSE.
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_fullgraph_forward_and_backward_match_eager(name):
    inst = CATALOGUE[name].make(B, H, L, L, "cpu")
    bm = inst.block_mask(B, H, L, L, "cpu")
    q, k, v = qkv(requires_grad=True)
    wanted = (q, k, v, *inst.learnable, *([inst.sinks] if inst.sinks is not None else []))

    def attend(q, k, v, bm):
        return inst.attend(q, k, v, block_mask=bm)

    eager = attend(q, k, v, bm)
    eager.sum().backward()
    expected = grads(*wanted)
    compiled, counter = counted(attend)
    out = compiled(q, k, v, bm)
    out.sum().backward()
    assert rel_err(out, eager) < 1e-5
    for got, want in zip(grads(*wanted), expected):
        assert rel_err(got, want) < 1e-5
    assert counter.frame_count == 1


def test_inductor_compiles_the_op():
    q, k, v = qkv(requires_grad=True)
    bias = torch.randn(H, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (kv_idx - q_idx)

    def attend(q, k, v, bm):
        return flex_attention(q, k, v, score_mod=biased, block_mask=bm).sin()

    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    eager = attend(q, k, v, bm)
    eager.sum().backward()
    expected = grads(q, k, v, bias)
    compiled, _ = counted(attend, backend="inductor")
    out = compiled(q, k, v, bm)
    out.sum().backward()
    assert rel_err(out, eager) < 1e-5
    for got, want in zip(grads(q, k, v, bias), expected):
        assert rel_err(got, want) < 1e-5


def test_new_masks_and_new_contents_do_not_recompile_and_are_followed():
    q, k, v = qkv()
    doc = torch.zeros(L, dtype=torch.int32)
    bias = torch.zeros(H)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    def attend(q, k, v, bm):
        return flex_attention(q, k, v, score_mod=biased, block_mask=bm)

    compiled, counter = counted(attend)
    for step, cut in enumerate((64, 40, 100)):
        doc.copy_((torch.arange(L) >= cut).int())  # new contents of a tensor the mask_mod reads
        bias.copy_(torch.randn(H))  # and of one the score_mod reads
        bm = create_block_mask(document, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)  # a new mask, same shapes
        assert rel_err(compiled(q, k, v, bm), attend(q, k, v, bm)) < 1e-5, step
    assert counter.frame_count == 1


def test_a_new_closure_over_new_tensors_reuses_the_graph():
    # Masks rebuilt each step close over a new tensor (torchtitan's document masks): same code, same shapes.
    q, k, v = qkv()

    def document_mask(doc):
        def same_document(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return same_document

    def attend(q, k, v, bm):
        return flex_attention(q, k, v, block_mask=bm)

    compiled, counter = counted(attend)
    for cut in (30, 90):
        mod = document_mask((torch.arange(L) >= cut).int())
        bm = create_block_mask(mod, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
        assert rel_err(compiled(q, k, v, bm), attend(q, k, v, bm)) < 1e-5
    assert counter.frame_count == 1


def test_a_changed_constant_recompiles_and_gives_the_new_result():
    q, k, v = qkv()

    def softcap(cap):
        def capped(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return capped

    def attend(q, k, v, score_mod):
        return flex_attention(q, k, v, score_mod=score_mod)

    compiled, counter = counted(attend)
    for cap in (0.5, 0.25, 0.5):
        assert rel_err(compiled(q, k, v, softcap(cap)), attend(q, k, v, softcap(cap))) < 1e-5, cap
    assert counter.frame_count >= 2  # the new constant recompiled


def test_a_rebound_global_is_followed():
    q, k, v = qkv()
    global _SCALE_FOR_TEST
    _SCALE_FOR_TEST = torch.full((H,), 2.0)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * _SCALE_FOR_TEST[h]

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=scaled)

    compiled, counter = counted(attend)
    first = compiled(q, k, v)
    _SCALE_FOR_TEST = torch.full((H,), 0.5)  # another object, same shape: no recompile, new values
    second = compiled(q, k, v)
    assert rel_err(second, attend(q, k, v)) < 1e-5 and not torch.allclose(first, second)
    assert counter.frame_count == 1


def test_tensors_of_one_shape_keep_their_roles():
    # Two captured tensors of the same shape, first used in different ways: a swap would change the result.
    q, k, v = qkv()
    first, second = torch.randn(H), torch.randn(H) * 3

    def two(score, b, h, q_idx, kv_idx):
        scale = torch.exp(second[h] * 0.1)
        return torch.where(q_idx >= kv_idx, score * scale + first[h], score - first[h] * second[h])

    table = torch.randn(L)

    def shapes_first(score, b, h, q_idx, kv_idx):  # reads table's shape before any tensor's values
        last = table.shape[0] - 1
        return score * second[h] + first[h] + table[torch.clamp(kv_idx - q_idx, 0, last)]

    for mod in (two, shapes_first):
        def attend(q, k, v):
            return flex_attention(q, k, v, score_mod=mod)

        compiled, _ = counted(attend)
        assert rel_err(compiled(q, k, v), attend(q, k, v)) < 1e-5, mod.__name__


def test_a_mod_defined_inside_the_compiled_function():
    q, k, v = qkv()

    def capped_by(cap):
        def capped(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return capped

    def attend(q, k, v, cap: float):
        def capped(score, b, h, q_idx, kv_idx):  # a new closure per call, over a Python float
            return cap * torch.tanh(score / cap)
        both = flexattn.and_masks(causal, lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 100)  # over functions
        bm = torch.compiler.disable(create_block_mask)(both, 1, 1, L, L, device="cpu")
        return flex_attention(q, k, v, score_mod=capped, block_mask=bm), flex_attention(q, k, v, score_mod=capped_by(cap))

    compiled = torch.compile(attend, backend="aot_eager")  # the mask is built eagerly (a graph break)
    for got, want in zip(compiled(q, k, v, 0.5), attend(q, k, v, 0.5)):
        assert rel_err(got, want) < 1e-5


def test_mods_made_inside_by_a_mod_factory_may_close_over_tensors_of_the_graph():
    q, k, v = qkv(requires_grad=True)
    weight = torch.randn(H, requires_grad=True)

    @flexattn.mod_factory
    def biased_by(bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[h] * (kv_idx - q_idx)
        return biased

    def attend(q, k, v, weight):
        return flex_attention(q, k, v, score_mod=biased_by(weight.tanh() * 2))  # a tensor computed in the graph

    eager = attend(q, k, v, weight)
    eager.sum().backward()
    expected = grads(q, k, v, weight)
    compiled, counter = counted(attend)
    out = compiled(q, k, v, weight)
    out.sum().backward()
    assert rel_err(out, eager) < 1e-5
    for got, want in zip(grads(q, k, v, weight), expected):
        assert rel_err(got, want) < 1e-5
    assert counter.frame_count == 1


def test_a_decoding_step_gpt_fast_style_compiles_fullgraph():
    # The step slices the mask's rows with a tensor position and sets the shifted mask_mod and lengths.
    S = 256
    q, k, v = qkv(L=1, S=S)
    full = create_block_mask(causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=64)
    kv_blocks = BlockMask.from_kv_blocks(full.kv_num_blocks, full.kv_indices, full.full_kv_num_blocks,
                                         full.full_kv_indices, BLOCK_SIZE=64, mask_mod=causal, compute_q_blocks=False)

    def step(q, k, v, input_pos):
        mask = kv_blocks[:, :, input_pos // kv_blocks.BLOCK_SIZE[0]]
        mask.mask_mod = flexattn.offset_mask_mod(kv_blocks.mask_mod, input_pos)
        mask.seq_lengths = (1, S)
        return flex_attention(q, k, v, block_mask=mask)

    compiled, counter = counted(step)
    for pos in (3, 130, 255):
        position = torch.tensor(pos)
        assert rel_err(compiled(q, k, v, position), step(q, k, v, position)) < 1e-5, pos
    assert counter.frame_count == 1


def test_decode_block_mask_and_a_paged_cache_compile_fullgraph():
    # A packed batch of two sequences in one paged cache, viewed as one flat sequence of pages.
    page, pages, S = 32, 8, 128
    paged = flexattn.PagedAttention(pages, page, 2, device="cpu")
    for row in range(2):
        paged.reserve(row, S)
    k_cache, v_cache = torch.zeros(1, H, pages * page, E), torch.zeros(1, H, pages * page, E)
    k, v = torch.randn(2, H, S, E), torch.randn(2, H, S, E)
    paged.assign(torch.arange(2), torch.arange(S).expand(2, S), k, v, k_cache, v_cache)
    full = create_block_mask(causal, 2, 1, S, S, device="cpu", BLOCK_SIZE=page)
    lengths = torch.tensor([96, 128])

    def step(q, offset):
        logical = flexattn.decode_block_mask(full, offset, q_len=1, kv_lengths=lengths)
        physical = paged.convert_logical_block_mask(logical, kv_len=lengths)
        return flex_attention(q, k_cache, v_cache, block_mask=physical)

    compiled, counter = counted(step)
    for offset in ((95, 127), (40, 60)):
        q = torch.randn(2, H, 1, E)
        offset = torch.tensor(offset)
        assert rel_err(compiled(q, offset), step(q, offset)) < 1e-5
    assert counter.frame_count == 1


def test_a_mod_defined_inside_over_a_tensor_is_refused_at_compile_time():
    # Such a closure has no Python object outside the graph to trace; docs/compile.md says to define it outside.
    q, k, v = qkv()
    bias = torch.randn(H)

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[h])

    with pytest.raises(Exception, match="closure"):
        torch.compile(attend, backend="eager", fullgraph=True)(q, k, v)


def test_new_lengths_recompile_once_each_and_not_with_dynamic_shapes():
    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5)

    compiled, counter = counted(attend)
    for length in (64, 96, 64, 96):
        q, k, v = qkv(L=length, S=length)
        assert rel_err(compiled(q, k, v), attend(q, k, v)) < 1e-5
    assert counter.frame_count == 2
    torch._dynamo.reset()
    compiled, counter = counted(attend, dynamic=True)
    for length in (64, 96, 80):
        q, k, v = qkv(L=length, S=length)
        assert rel_err(compiled(q, k, v), attend(q, k, v)) < 1e-5
    assert counter.frame_count == 1


def test_flex_attention_itself_compiles_fullgraph_with_its_options():
    # As vLLM and transformers call torch's: torch.compile(flex_attention, fullgraph=True).
    q, k, v = qkv(requires_grad=True, Hkv=1)
    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    compiled, counter = counted(flex_attention)
    out, aux = compiled(q, k, v, block_mask=bm, enable_gqa=True, scale=0.3, return_aux=AuxRequest(lse=True))
    want, want_aux = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, scale=0.3,
                                    return_aux=AuxRequest(lse=True))
    assert rel_err(out, want) < 1e-5 and rel_err(aux.lse, want_aux.lse) < 1e-5 and aux.max_scores is None
    # torch's AuxRequest and BlockMask (what transformers passes) take the same route.
    tfa = pytest.importorskip("torch.nn.attention.flex_attention")
    theirs = tfa.create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    out, lse = compiled(q, k, v, block_mask=theirs, enable_gqa=True, return_aux=tfa.AuxRequest(lse=True))
    assert rel_err(out, flex_attention(q, k, v, block_mask=bm, enable_gqa=True)) < 1e-5
    (out.sum() + lse.lse.sum()).backward()
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("fullgraph", [True, False])
def test_create_block_mask_inside_a_compiled_region_says_to_build_it_outside(fullgraph):
    # flexattn's message is the error's first line, not the debug context of Dynamo's "Observed
    # exception"; without fullgraph it is raised too, not hidden by a graph break.
    q, k, v = qkv()

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=create_block_mask(causal, 1, 1, L, L, device="cpu"))

    with pytest.raises(InvalidInputError) as raised:
        torch.compile(attend, backend="eager", fullgraph=fullgraph)(q, k, v)
    first_line = str(raised.value).splitlines()[0]
    assert first_line.startswith("create_block_mask(causal, ...) was called inside a torch.compile'd function")
    assert "build the BlockMask outside the compiled function" in first_line


def test_errors_name_the_fix_under_compile():
    q, k, v = qkv()
    bm = create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(Exception, match="create a new block mask"):
        torch.compile(flex_attention, backend="eager", fullgraph=True)(q, k, v, block_mask=bm)
    with pytest.raises(Exception, match="unknown kernel_options"):
        torch.compile(flex_attention, backend="eager", fullgraph=True)(q, k, v, kernel_options={"BLOK_M": 1})
    rows = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)[:, :, torch.tensor([1])]
    rows.seq_lengths = (64, L)  # rows selected, the mask_mod not shifted: the eager error's explanation
    with pytest.raises(Exception, match="decode_block_mask"):
        torch.compile(flex_attention, backend="eager", fullgraph=True)(q[:, :, :64], k, v, block_mask=rows)
    two_heads = create_block_mask(causal, 1, 3, L, L, device="cpu", BLOCK_SIZE=64)  # the query has 2 heads
    with pytest.raises(Exception, match="must be 1 \\(broadcast\\) or match the query"):
        torch.compile(flex_attention, backend="eager", fullgraph=True)(q, k, v, block_mask=two_heads)


def test_the_fake_outputs_are_the_real_ones():
    # Shapes, dtypes and strides of every output, forward and backward, against the real op.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexattn.api import _registered_call
    from flexattn.compile import flex_attention_backward_op, flex_attention_op

    bias = torch.randn(H, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    q, k, v = qkv(Hkv=1)
    v = torch.randn(B, 1, L, 24)
    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    key = _registered_call(biased, causal, None, q.device)
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    args = (q, k, v, *tables, [bias], [], [], [], key, [64, 64], [L, L], 0.25, True, True)
    real = flex_attention_op(*args)
    bwd_args = (q, k, v, real[0], real[1], torch.randn_like(real[0]), None, *tables, [bias], [], [], [], key,
                [64, 64], [L, L], 0.25, [True])
    real_bwd = flex_attention_backward_op(*bwd_args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.flexattn.flex_attention(*args)
        fake_bwd = torch.ops.flexattn.flex_attention_backward(*bwd_args)
    flat = list(real) + list(real_bwd[:3]) + list(real_bwd[3])
    flat_fake = list(fake) + list(fake_bwd[:3]) + list(fake_bwd[3])
    for r, f in zip(flat, flat_fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_the_triton_kernels_run_inside_the_compiled_graph():
    # The same op on the Triton backend (the interpreter here): the kernels' forward and backward.
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    inst = CATALOGUE["alibi"].make(B, H, L, L, "cpu")
    bm = inst.block_mask(B, H, L, L, "cpu")
    q, k, v = qkv(requires_grad=True)
    options = {"BACKEND": "TRITON"}

    def attend(q, k, v, bm):
        return flex_attention(q, k, v, score_mod=inst.score_mod, block_mask=bm, kernel_options=options)

    eager = attend(q, k, v, bm)
    eager.sum().backward()
    expected = grads(q, k, v)
    compiled, _ = counted(attend)
    out = compiled(q, k, v, bm)
    out.sum().backward()
    assert torch.equal(out, eager)
    for got, want in zip(grads(q, k, v), expected):
        assert torch.equal(got, want)


def test_a_compiled_backward_lowers_the_gradient_of_a_fresh_mod_right(monkeypatch):
    # The backward op runs without grad mode: the first lowering of a mod's gradient, there, once
    # gave every derivative as 0 (and kept it for later mods). Compiled first, on a mask without
    # full blocks (whose zero dS would have compiled), against the PyTorch backend.
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.lowering.gradient as gradient

    monkeypatch.setattr(gradient, "_vjp_cache", type(gradient._vjp_cache)())
    slopes = torch.rand(H, requires_grad=True)

    def fresh_bias(score, b, h, q_idx, kv_idx):  # a mod of its own: no lowering of it is kept yet
        return score * 0.9 + slopes[h] * (kv_idx - q_idx).abs() * -0.05

    bm = create_block_mask(causal, None, None, L, L, device="cpu", separate_full_blocks=False)
    q, k, v = qkv(requires_grad=True)

    def attend(q, k, v, bm, backend):
        return flex_attention(q, k, v, score_mod=fresh_bias, block_mask=bm, kernel_options={"BACKEND": backend})

    compiled, _ = counted(attend)
    compiled(q, k, v, bm, "TRITON").sum().backward()
    got = grads(q, k, v, slopes)
    attend(q, k, v, bm, "PYTORCH").sum().backward()
    for name, g, want in zip(("dq", "dk", "dv", "dslopes"), got, grads(q, k, v, slopes)):
        assert rel_err(g, want) < 1e-5, name


def test_the_model_benchmark_runs_its_smoke_sizes(tmp_path):
    # python -m flexattn.bench --mode model --smoke: the code paths of the GPU benchmark, tiny, on a CPU.
    import json

    from flexattn.bench import run_mode

    out = tmp_path / "model.json"
    assert run_mode("model", ["--smoke", "--impls", "flexattn,sdpa", "--modes", "eager,compile", "--masks", "causal",
                              "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"device", "torch", "triton"} <= report["env"].keys()
    assert {(r["impl"], r["mode"]) for r in report["results"]} == {
        ("flexattn", "eager"), ("flexattn", "compile"), ("sdpa", "eager"), ("sdpa", "compile")}
    assert all(r["tokens_per_s"] > 0 and r["host_ms"] > 0 for r in report["results"])
    assert all(r["sm_clock_mhz"] is None for r in report["results"])  # a CPU has no SM clock to report


def test_the_model_profile_needs_a_gpu_and_says_so(capsys):
    from benchmarks import model_profile

    if torch.cuda.is_available():
        pytest.skip("on a GPU it profiles (run on the device)")
    assert model_profile.main(["--impl", "flexattn", "--mode", "compile"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_model_benchmark_runs_a_cold_case_in_a_fresh_process(tmp_path):
    # --cold: each case in a process of its own with empty caches (what a user's first run pays).
    import json

    from flexattn.bench import run_mode

    out = tmp_path / "model.json"
    assert run_mode("model", ["--smoke", "--cold", "--impls", "flexattn", "--modes", "eager", "--masks", "causal",
                              "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["cold"] is True
    (row,) = report["results"]
    assert row["cold"] is True and row["impl"] == "flexattn" and row["tokens_per_s"] > 0


def test_a_masks_checked_row_statistics_follow_its_tables(monkeypatch):
    # The first mask of a shape is checked once and its row statistics kept (the forward's
    # consecutive-block path); a new mask of that shape, or a table changed in place, is not read back
    # and takes the trusted plan. Triton kernels (the interpreter): the path the statistics steer.
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.kept as kept_module

    checks = []
    real_check = kept_module.checked_launch_tables
    monkeypatch.setattr(kept_module, "checked_launch_tables", lambda mask: checks.append(1) or real_check(mask))
    monkeypatch.setattr(kept_module, "_SHAPES_CHECKED", {})
    q, k, v = qkv(L=256, S=256)
    options = {"BACKEND": "TRITON"}

    def attend(q, k, v, bm):
        return flex_attention(q, k, v, block_mask=bm, kernel_options=options)

    compiled, _ = counted(attend)
    bm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    for _ in range(2):
        assert torch.equal(compiled(q, k, v, bm), attend(q, k, v, bm))
    assert len(checks) == 1
    # Row 3's full blocks 0, 1, 2 become 0, 2 in place: no longer consecutive; the stamp sees it.
    bm.full_kv_indices[0, 0, 3, :2] = torch.tensor([0, 2], dtype=torch.int32)
    bm.full_kv_num_blocks[0, 0, 3] = 2
    assert torch.equal(compiled(q, k, v, bm), attend(q, k, v, bm))
    other = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    assert torch.equal(compiled(q, k, v, other), attend(q, k, v, other))
    assert len(checks) == 1


def test_a_new_mask_of_a_checked_shape_is_assumed_as_dense_as_the_first(monkeypatch):
    # A mask whose contents the host does not read (a new one of a shape already checked, or the
    # static copy a CUDA-graph capture sees) takes the first checked mask's mean row length for the
    # launch choices, never its consecutive-block flags (on which results depend).
    import flexattn.compile.kept as kept_module
    from flexattn.kernels.tables import launch_tables

    monkeypatch.setattr(kept_module, "_SHAPES_CHECKED", {})
    q, k, _ = qkv(L=512, S=512)

    def op_mask(bm):
        tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
        return kept_module.op_block_mask(q, k, tables, bm.BLOCK_SIZE, bm.seq_lengths, 1)

    first = create_block_mask(causal, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    checked = launch_tables(op_mask(first)).stats
    assert checked.mean_blocks == 4.5 and checked.consecutive_partial and checked.consecutive_full
    other = create_block_mask(causal, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    assumed = launch_tables(op_mask(other)).stats
    assert assumed == (4.5, False, False)  # not the table's width (8), and no consecutive path
    narrow = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    narrow_new = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    op_mask(narrow)
    assert launch_tables(op_mask(narrow_new)).stats == (2.5, False, False)  # per shape


def test_the_backward_tables_of_a_mask_are_derived_once_for_its_layers(monkeypatch):
    # Every layer's call makes a new BlockMask on the same tables: the transposed tables the Triton
    # backward walks are kept per table object (stamped), not derived again per layer.
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.kernels.tables as tables_module

    derived = []
    real = tables_module._compute_backward_tables
    monkeypatch.setattr(tables_module, "_compute_backward_tables", lambda mask: derived.append(1) or real(mask))
    q, k, v = qkv(requires_grad=True)
    options = {"BACKEND": "TRITON"}

    def two_layers(q, k, v, bm):
        y = flex_attention(q, k, v, block_mask=bm, kernel_options=options)
        return flex_attention(y, k, v, block_mask=bm, kernel_options=options)

    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    two_layers(q, k, v, bm).sum().backward()
    expected = grads(q, k, v)
    compiled, _ = counted(two_layers)
    derived.clear()
    compiled(q, k, v, bm).sum().backward()
    assert derived == [1]
    for got, want in zip(grads(q, k, v), expected):
        assert torch.equal(got, want)
    bm.kv_num_blocks.add_(0)  # a new version: derived again
    compiled(q, k, v, bm).sum().backward()
    assert derived == [1, 1]


def test_what_a_mask_derives_is_kept_per_stream(monkeypatch):
    # Tables derived on the device by a call on one stream are read after it only by calls on that
    # stream (stream order): a call on another stream derives its own, and each stream then keeps
    # its own set, so a steady state on any stream derives and allocates nothing (cuda_graphs.py).
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.kept as kept_module
    import flexattn.compile.warm as warm_module
    import flexattn.kernels.tables as tables_module

    stream = ["first"]
    for module in (kept_module, warm_module):
        monkeypatch.setattr(module, "stream_key", lambda device: stream[0])
    derived = []
    real = tables_module._compute_backward_tables
    monkeypatch.setattr(tables_module, "_compute_backward_tables", lambda mask: derived.append(stream[0]) or real(mask))
    q, k, v = qkv(requires_grad=True)
    options = {"BACKEND": "TRITON"}

    def two_layers(q, k, v, bm):
        y = flex_attention(q, k, v, block_mask=bm, kernel_options=options)
        return flex_attention(y, k, v, block_mask=bm, kernel_options=options)

    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    two_layers(q, k, v, bm).sum().backward()
    expected = grads(q, k, v)
    compiled, _ = counted(two_layers)
    derived.clear()
    for name in ("first", "second", "first", "second"):
        stream[0] = name
        compiled(q, k, v, bm).sum().backward()
        for got, want in zip(grads(q, k, v), expected):
            assert torch.equal(got, want)
    assert derived == ["first", "second"]


def test_the_mask_of_a_call_without_one_is_kept_per_stream(monkeypatch):
    import flexattn.masks.create as create_module

    stream = ["first"]
    monkeypatch.setattr(create_module, "stream_key", lambda device: stream[0])
    first = create_module.dense_block_mask(300, 500, torch.device("cpu"))
    assert create_module.dense_block_mask(300, 500, torch.device("cpu")) is first
    stream[0] = "second"
    second = create_module.dense_block_mask(300, 500, torch.device("cpu"))
    assert second is not first and torch.equal(second.kv_indices, first.kv_indices)
    stream[0] = "first"
    assert create_module.dense_block_mask(300, 500, torch.device("cpu")) is first


def test_the_op_calls_its_body_directly_only_without_gradients_modes_or_subclasses(monkeypatch):
    # [Note] The forward op's autograd kernel: the shortcut past the second dispatch is taken only
    # when nothing between autograd and the device kernel could need the op's own dispatch.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flexattn.compile.ops as ops_module
    from flexattn.api import _registered_call

    q, k, v = (t.detach() for t in qkv())
    bm = create_block_mask(causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    key = _registered_call(None, causal, None, q.device)
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    args = [q, k, v, *tables, [], [], [], [], key, [64, 64], [L, L], 0.25, True, False]
    direct = []
    body = ops_module._forward_body
    monkeypatch.setattr(ops_module, "_forward_body", lambda *a: direct.append(1) or body(*a))
    op = torch.ops.flexattn.flex_attention
    expected = flex_attention(q, k, v, block_mask=bm, scale=0.25)

    with torch.no_grad():
        out = op(*args)[0]
    assert len(direct) == 1 and torch.equal(out, expected)
    out = op(*args)[0]  # grad mode on, but nothing requires grad
    assert len(direct) == 2 and torch.equal(out, expected)

    q_grad = q.clone().requires_grad_()
    out = op(q_grad, *args[1:])[0]
    assert len(direct) == 2 and out.grad_fn is not None
    out.sum().backward()
    assert q_grad.grad is not None and torch.isfinite(q_grad.grad).all()

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Seen() as seen:
        out = op(*args)[0]
    assert len(direct) == 2 and torch.ops.flexattn.flex_attention.default in seen.ops
    assert torch.equal(out, expected)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        fake = op(*args)[0]
    assert len(direct) == 2 and fake.shape == expected.shape


def test_the_shapes_checked_are_bounded(monkeypatch):
    # A decoding loop under torch.compile meets a new table shape at every length: the per-shape
    # densities must not pile up. The oldest goes first; a mask of its shape is then checked again.
    import flexattn.compile.kept as kept_module

    monkeypatch.setattr(kept_module, "_SHAPES_CHECKED", {})
    monkeypatch.setattr(kept_module, "_SHAPES_KEPT", 2)
    q, k, _ = qkv(L=512, S=512)
    for length in (128, 256, 384):
        bm = create_block_mask(causal, 1, 1, length, length, device="cpu", BLOCK_SIZE=64)
        tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
        kept_module.op_block_mask(q[:, :, :length], k[:, :, :length], tables, bm.BLOCK_SIZE, bm.seq_lengths, 1)
    assert [shape[-1] for shape in kept_module._SHAPES_CHECKED] == [(256, 256), (384, 384)]


def test_warm_calls_launch_the_kept_plan_and_follow_what_changed(monkeypatch):
    # [Note] Warm calls of the forward op: the second call of a problem skips the decisions and
    # launches the first call's plan. New captured contents are read at launch; a table written in
    # place, another mask, another alignment of q or a new scale go the long way again. Each result
    # against the eager call on the same inputs (the interpreter runs the Triton kernels).
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.ops as ops_module
    import flexattn.compile.warm as warm_module

    monkeypatch.setattr(warm_module, "_WARM", {})
    decided = []
    real_call = ops_module._call
    monkeypatch.setattr(ops_module, "_call", lambda *a, **kw: decided.append(1) or real_call(*a, **kw))
    bias = torch.randn(H)
    options = {"BACKEND": "TRITON"}

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    def attend(q, k, v, bm, scale=None):
        return flex_attention(q, k, v, score_mod=head_bias, block_mask=bm, scale=scale, kernel_options=options)

    compiled, _ = counted(attend)
    q, k, v = qkv(L=256, S=256)
    bm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    for calls in (1, 1, 1):
        assert torch.equal(compiled(q, k, v, bm), attend(q, k, v, bm))
        assert len(decided) == calls
    bias.add_(1.0)  # new contents, same tensor: read at launch
    assert torch.equal(compiled(q, k, v, bm), attend(q, k, v, bm))
    assert len(decided) == 1
    # Row 3's full blocks 0, 1, 2 become 0, 2 in place: the checked statistics no longer hold.
    bm.full_kv_indices[0, 0, 3, :2] = torch.tensor([0, 2], dtype=torch.int32)
    bm.full_kv_num_blocks[0, 0, 3] = 2
    assert torch.equal(compiled(q, k, v, bm), attend(q, k, v, bm))
    assert len(decided) == 2
    other = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 100), 1, 1, 256, 256,
                              device="cpu", BLOCK_SIZE=64)
    assert torch.equal(compiled(q, k, v, other), attend(q, k, v, other))
    assert len(decided) == 3
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)  # 4 bytes off a 16-byte boundary
    shifted.copy_(torch.randn(q.shape))
    assert torch.equal(compiled(shifted, k, v, other), attend(shifted, k, v, other))
    assert len(decided) == 4
    assert torch.equal(compiled(q, k, v, other, 0.5), attend(q, k, v, other, 0.5))
    assert len(decided) == 5


def _portable_causal_with_empty_warm_store(monkeypatch, store: str):
    """(flexattn.compile.warm, a compiled portable causal call, its 128-token mask), with ``store``
    (``_WARM`` or ``_WARM_BACKWARD``) emptied for the test. Skips without Triton's interpreter."""
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.warm as warm_module

    monkeypatch.setattr(warm_module, store, {})
    compiled, _ = counted(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm,
                                                             kernel_options={"BACKEND": "TRITON"}))
    return warm_module, compiled, create_block_mask(causal, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=64)


def test_a_warm_entry_keeps_no_tensor_of_the_call_that_made_it(monkeypatch):
    # The warm launch works out strides, lengths and descriptors from the first call of a problem
    # and keeps them; it must not keep that call's tensors (activations held alive; inside a
    # CUDA-graph capture, memory of the graph's pool that the graph does not know of).
    warm_module, compiled, bm = _portable_causal_with_empty_warm_store(monkeypatch, "_WARM")
    q, k, v = qkv(L=128, S=128)
    out = compiled(q, k, v, bm)
    assert len(warm_module._WARM) == 1
    assert torch.equal(compiled(q, k, v, bm), out)  # a warm call
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


def test_warm_backward_calls_launch_the_kept_launches_and_follow_what_changed(monkeypatch):
    # [Note] Warm calls of the backward op: the second backward of a problem skips the decisions and
    # launches what the first kept. New inputs and new captured contents are read at launch; a
    # table written in place, another mask or a new scale go the long way again, and so does every
    # call whose captured tensor wants a gradient. Gradients against the eager call's on the same
    # inputs (the interpreter runs the same Triton kernels).
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.ops as ops_module
    import flexattn.compile.warm as warm_module

    monkeypatch.setattr(warm_module, "_WARM_BACKWARD", {})
    long_way = []
    real_run_backward = ops_module.run_backward
    monkeypatch.setattr(ops_module, "run_backward",
                        lambda *a, **kw: long_way.append(1) or real_run_backward(*a, **kw))
    bias = torch.randn(H)
    options = {"BACKEND": "TRITON"}

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    def attend(q, k, v, bm, scale=None):
        return flex_attention(q, k, v, score_mod=head_bias, block_mask=bm, scale=scale, kernel_options=options)

    compiled, _ = counted(attend)

    def check(bm, scale=None, long_calls=None):
        q, k, v = qkv(L=256, S=256, requires_grad=True)
        dout = torch.randn(B, H, 256, E)
        got = torch.autograd.grad(compiled(q, k, v, bm, scale), (q, k, v), dout)
        expected = torch.autograd.grad(attend(q, k, v, bm, scale), (q, k, v), dout)
        for g, e in zip(got, expected):
            assert torch.equal(g, e)
        if long_calls is not None:
            assert len(long_way) == long_calls

    bm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    long_way.clear()
    check(bm, long_calls=1)  # counted: the compiled calls' long way (the eager call has its own)
    assert len(warm_module._WARM_BACKWARD) == 1
    check(bm, long_calls=1)
    check(bm, long_calls=1)
    bias.add_(1.0)  # new contents, same tensor: read at launch
    check(bm, long_calls=1)
    # Row 3's full blocks 0, 1, 2 become 0, 2 in place: the transposed tables kept for them are stale.
    bm.full_kv_indices[0, 0, 3, :2] = torch.tensor([0, 2], dtype=torch.int32)
    bm.full_kv_num_blocks[0, 0, 3] = 2
    check(bm, long_calls=2)
    check(bm, long_calls=2)  # warm again, with the new tables' own transposed tables
    other = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 100), 1, 1, 256, 256,
                              device="cpu", BLOCK_SIZE=64)
    check(other, long_calls=3)
    check(other, 0.5, long_calls=4)
    check(other, 0.5, long_calls=4)


def test_a_backward_whose_captured_tensor_wants_a_gradient_always_goes_the_long_way(monkeypatch):
    # The warm launches return no gradients of captured tensors: a learnable bias must not get one.
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.warm as warm_module

    monkeypatch.setattr(warm_module, "_WARM_BACKWARD", {})
    # A learnable temperature per head. (Not a bias added per head: softmax ignores a constant added
    # to a row, so that gradient is zero and only rounding noise was compared.)
    bias = (1 + 0.1 * torch.randn(H)).requires_grad_()

    def head_bias(score, b, h, q_idx, kv_idx):
        return score * bias[h]

    def attend(q, k, v, bm):
        return flex_attention(q, k, v, score_mod=head_bias, block_mask=bm, kernel_options={"BACKEND": "TRITON"})

    compiled, _ = counted(attend)
    bm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    for _ in range(2):
        q, k, v = qkv(L=256, S=256, requires_grad=True)
        dout = torch.randn(B, H, 256, E)
        got = torch.autograd.grad(compiled(q, k, v, bm), (q, k, v, bias), dout)
        expected = torch.autograd.grad(attend(q, k, v, bm), (q, k, v, bias), dout)
        for g, e in zip(got, expected):
            assert rel_err(g, e) < 1e-5
    assert warm_module._WARM_BACKWARD == {}


def test_a_warm_backward_entry_keeps_no_tensor_of_the_call_that_made_it(monkeypatch):
    # Like the forward's: no q, k, v, output, LSE, gradient or result of the first call is kept, and
    # the transposed tables only through the mask's own record (they go when the tables go).
    warm_module, compiled, bm = _portable_causal_with_empty_warm_store(monkeypatch, "_WARM_BACKWARD")
    q, k, v = qkv(L=128, S=128, requires_grad=True)
    out = compiled(q, k, v, bm)
    first = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(warm_module._WARM_BACKWARD) == 1
    out = compiled(q, k, v, bm)
    again = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))  # a warm call
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    (entry,) = warm_module._WARM_BACKWARD.values()
    refs = [weakref.ref(t) for t in (q, k, v, out, *first, *again)]
    del q, k, v, out, first, again
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    transposed = [weakref.ref(t) for t in entry.kept().backward]
    del bm
    gc.collect()
    assert entry.kept() is None and all(r() is None for r in transposed)


def test_every_kernel_option_is_guarded_so_other_options_recompile(monkeypatch):
    # One code object (a closure made again over new options, one backend): Dynamo reused a graph for
    # options that differed only by a key it had not seen read (none, then BACKEND; one more tile
    # option), so the call ran with the first options. Each call must run with its own.
    import flexattn.compile.ops as ops_module

    seen = []
    real_call = ops_module._call
    monkeypatch.setattr(ops_module, "_call", lambda mods, *a, **kw: seen.append(mods) or real_call(mods, *a, **kw))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    q, k, v = qkv(L=128, S=128)
    bm = create_block_mask(causal, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=64)
    runs = [{}, {"BACKEND": "PYTORCH"}, {"BACKEND": "PYTORCH", "DETERMINISTIC": True}, {"BACKEND": "PYTORCH"}]
    for options in runs:
        def attend(q, k, v):
            return flex_attention(q, k, v, block_mask=bm, kernel_options=options)

        torch.compile(attend, backend=counter, fullgraph=True)(q, k, v)
        assert seen[-1].options == options
    assert counter.frame_count == 3  # the last options are the second's: that graph again


def test_a_warm_call_never_takes_the_plan_of_a_freed_table_whose_id_came_back():
    # Tables are matched by identity through weak references, not by id(): a table freed and a new
    # one made at the same address and id() is another table.

    from flexattn.compile.warm import _WarmTables

    first = torch.zeros(1, 1, 4, dtype=torch.int32)
    same_id = id(first)
    entry = _WarmTables((weakref.ref(first), None, None, None), None, False, (), None, None)
    assert entry.holds((first, None, None, None))
    del first
    for _ in range(1000):  # CPython hands a freed object's id to a new object of its size
        second = torch.zeros(1, 1, 4, dtype=torch.int32)
        if id(second) == same_id:
            break
    assert not entry.holds((second, None, None, None))
    assert not entry.holds((second, second, None, None))


def test_masks_made_under_inference_mode_run_eagerly_and_compiled_and_follow_changes_in_place():
    # Serving code runs under torch.inference_mode, where the tables are inference tensors with no
    # version counter (reading it raised before): nothing derived from them is reused, so a table
    # changed in place there is followed. Eager and compiled, Triton kernels (the interpreter).
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    options = {"BACKEND": "TRITON"}
    compiled = torch.compile(flex_attention, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        q, k, v = qkv(L=256, S=256)
        bm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
        expected = flex_attention(q, k, v, block_mask=bm)  # the PyTorch backend
        for run in (lambda: flex_attention(q, k, v, block_mask=bm, kernel_options=options),
                    lambda: compiled(q, k, v, block_mask=bm, kernel_options=options)):
            for _ in range(2):
                assert rel_err(run(), expected) < 1e-5
        # Row 3's full blocks 0, 1, 2 become 0, 2 in place (no longer consecutive).
        bm.full_kv_indices[0, 0, 3, :2] = torch.tensor([0, 2], dtype=torch.int32)
        bm.full_kv_num_blocks[0, 0, 3] = 2
        expected = flex_attention(q, k, v, block_mask=bm)
        assert rel_err(flex_attention(q, k, v, block_mask=bm, kernel_options=options), expected) < 1e-5
        assert rel_err(compiled(q, k, v, block_mask=bm, kernel_options=options), expected) < 1e-5


def test_compiled_calls_on_inference_mode_masks_read_their_tables_once_per_shape(monkeypatch):
    # The op's own mask lives for one call, so what it derives needs no version counter: tables made
    # under inference_mode are checked (read back) for the first mask of their shape only, as other
    # tables are, and later calls (a CUDA-graph capture among them) read nothing back.
    if not flexattn.kernels.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    import flexattn.compile.kept as kept_module
    import flexattn.kernels.tables as tables_module

    monkeypatch.setattr(kept_module, "_SHAPES_CHECKED", {})
    reads = []
    real = tables_module._compute_launch_tables
    monkeypatch.setattr(tables_module, "_compute_launch_tables", lambda mask: reads.append(1) or real(mask))
    options = {"BACKEND": "TRITON"}
    compiled = torch.compile(flex_attention, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        q, k, v = qkv(L=256, S=256)
        for _ in range(2):
            bm = create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
            expected = flex_attention(q, k, v, block_mask=bm)  # the PyTorch backend
            for _ in range(2):
                assert rel_err(compiled(q, k, v, block_mask=bm, kernel_options=options), expected) < 1e-5
    assert len(reads) == 1


def test_program_walks_are_kept_per_table_and_follow_changes_in_place(monkeypatch):
    # [Note] What a compiled call's mask derives, kept: each call makes a new BlockMask on the op's
    # tables; the Gluon forward's program walks (kernels/hopper/forward.py [Note] Programs across query blocks)
    # derived by one call are handed to the next calls on the same tables, until a table changes,
    # and a warm launch of union walks takes them from the current record only.
    import flexattn.compile.kept as kept_module
    import flexattn.compile.warm as warm_module
    from flexattn.kernels.tables import PROGRAM_WALKS, program_walks

    monkeypatch.setattr(kept_module, "_KEPT", kept_module.WeakTensorKeyDictionary())
    bm = create_block_mask(causal, 2, 1, 1024, 1024, device="cpu")
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    q = torch.empty(2, 1, 1024, 64)

    def op_mask():
        return kept_module.op_block_mask(q, q, tables, bm.BLOCK_SIZE, bm.seq_lengths, 1)

    class Arguments:  # the warm entry's tables part, reduced to what run() asks of it
        def arguments(self, tables, score_values, mask_values):
            return ()

    first = op_mask()
    assert not first.serves_one_call  # its maker keeps what it derives: the walks pay
    assert first.peek_derived(PROGRAM_WALKS) is None
    walks = program_walks(first)
    kept_module.keep_program_walks(first)
    assert op_mask().peek_derived(PROGRAM_WALKS) is walks  # the next layer's call: not derived again
    warm = warm_module._WarmForward(Arguments(), lambda *a, walks: walks,
                                    weakref.ref(kept_module.kept_record(first)))
    assert warm.run(q, q, q, tables, [], []) is walks
    bm.kv_indices[0, 0, 3, 0] = 0  # written in place (the same value): the stamp no longer holds
    again = op_mask()
    assert again.peek_derived(PROGRAM_WALKS) is None
    fresh = program_walks(again)
    assert fresh is not walks
    kept_module.keep_program_walks(again)
    assert op_mask().peek_derived(PROGRAM_WALKS) is fresh
    assert warm.run(q, q, q, tables, [], []) is None  # another record now: the long way
