"""Python numbers a mod reads, under torch.compile (issue 50, items 1 to 4).

A compiled call follows the value a mod reads now, whatever Dynamo made of it: a constant it
guards (a new value recompiles), or a symbolic value (a closure int that keeps changing: the graph
compiled for one value runs with the next, which the op reads at run time). One test per row of
docs/compile.md's table "What recompiles, and what does not" is named ``test_row_...``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch._dynamo.testing
import torch._dynamo.utils

import flexattn
from flexattn import create_block_mask, flex_attention
from flexattn.codegen import source as codegen_source
from flexattn.errors import InvalidInputError

# On a GPU the same tests run the compiled Triton kernels (the Triton backend, float32 inputs).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L = 128
VALUES = (4, 9, 13, 20, 27)
MODES = {
    "default": dict(),
    "dynamic": dict(dynamic=True),
    "fullgraph": dict(fullgraph=True),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, L, 16, generator=g).to(DEVICE) for _ in range(3)]


def compiled(fn, mode):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, **MODES[mode]), counter


def eager(q, k, v, **kwargs):
    return flex_attention(q, k, v, **kwargs)


def assert_follows_every_value(run, expected, values=VALUES):
    """``run(w)`` (compiled) equals ``expected(w)`` (eager) at every value, in order."""
    for w in values:
        got, want = run(w), expected(w)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"value {w}: off by {(got - want).abs().max()}"


def window(w):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= w, score, -score)
    return mod


# -- item 1: a number that changes between calls ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_row_a_closure_number_keeps_its_graph_and_follows_its_value(mode):
    # The case: from the third value on (the second with dynamic=True) the op ran the first
    # trace's constant. The int becomes symbolic after one recompile (none with dynamic=True).
    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, m: flex_attention(q, k, v, score_mod=m), mode)
    kernels = None
    for w in VALUES:
        assert torch.allclose(f(q, k, v, window(w)), eager(q, k, v, score_mod=window(w)), atol=1e-6)
        kernels = kernels or len(codegen_source._loaded)
    assert counter.frame_count == (1 if mode == "dynamic" else 2)
    assert len(codegen_source._loaded) == kernels  # the kernels compiled once


@pytest.mark.parametrize("mode", MODES)
def test_row_a_block_masks_mask_mod_number_keeps_its_graph_and_follows_its_value(mode):
    # A prefix-LM mask rebuilt each step for a new prefix length, passed to a compiled model.
    def prefix_lm(n):
        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (q_idx >= kv_idx)
        return mask

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm), mode)
    for n in (10, 20, 30, 70, 130):
        bm = create_block_mask(prefix_lm(n), None, None, L, L, device=DEVICE)
        assert torch.allclose(f(q, k, v, bm), eager(q, k, v, block_mask=bm), atol=1e-6), n
    assert counter.frame_count == (1 if mode == "dynamic" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_row_a_float_recompiles_once_per_value(mode):
    # Dynamo specialises floats (torch._dynamo.config.specialize_float): a new value recompiles,
    # and runs with its own value.
    def softcap(cap):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / cap) * cap
        return mod

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, m: flex_attention(q, k, v, score_mod=m), mode)
    caps = (2.5, 7.0, 30.0)
    assert_follows_every_value(lambda c: f(q, k, v, softcap(c)), lambda c: eager(q, k, v, score_mod=softcap(c)), caps)
    assert counter.frame_count <= len(caps) + 1  # Dynamo's second compile tries a symbolic float first


@pytest.mark.parametrize("mode", MODES)
def test_row_a_bool_recompiles_once_per_value(mode):
    def flag(on):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score, score * on)
        return mod

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, m: flex_attention(q, k, v, score_mod=m), mode)
    assert_follows_every_value(lambda x: f(q, k, v, flag(x)), lambda x: eager(q, k, v, score_mod=flag(x)),
                               (True, False, True))
    assert counter.frame_count <= 2


GLOBAL_WINDOW = 4


def global_window(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx - kv_idx <= GLOBAL_WINDOW, score, -score)


@pytest.mark.parametrize("mode", MODES)
def test_row_a_global_number_recompiles_once_per_value(mode):
    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=global_window), mode)

    def run(w):
        global GLOBAL_WINDOW
        GLOBAL_WINDOW = w
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=global_window))
    assert counter.frame_count == len(VALUES)  # Dynamo guards a global's value


@pytest.mark.parametrize("mode", MODES)
def test_row_a_dict_item_keeps_its_graph_and_follows_its_value(mode):
    config = {"w": 4}

    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= config["w"], score, -score)

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=mod), mode)

    def run(w):
        config["w"] = w
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=mod))
    assert counter.frame_count == (1 if mode == "dynamic" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_row_an_object_attribute_keeps_its_graph_and_follows_its_value(mode):
    class Config:
        window = 0

    cfg = Config()

    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= cfg.window, score, -score)

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=mod), mode)

    def run(w):
        cfg.window = w
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=mod))
    assert counter.frame_count == (1 if mode == "dynamic" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_row_a_default_argument_recompiles_once_per_value(mode):
    def mod(score, b, h, q_idx, kv_idx, w=4):
        return torch.where(q_idx - kv_idx <= w, score, -score)

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=mod), mode)

    def run(w):
        mod.__defaults__ = (w,)
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=mod))
    assert counter.frame_count == len(VALUES)  # Dynamo guards a function's defaults


@pytest.mark.parametrize("mode", MODES)
def test_row_a_captured_tensors_size_keeps_its_graph_and_follows_its_value(mode):
    # t.shape[0] of a tensor whose length changes: the size is a number the graph takes.
    def sized(t):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx - kv_idx <= t.shape[0], score, -score)
        return mod

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, m: flex_attention(q, k, v, score_mod=m), mode)
    assert_follows_every_value(lambda w: f(q, k, v, sized(torch.zeros(w))),
                               lambda w: eager(q, k, v, score_mod=sized(torch.zeros(w))))
    assert counter.frame_count == (1 if mode == "dynamic" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_tensor_of_another_length_is_traced_again(mode):
    # A table read by the mod whose length changes: the graph compiled for the first length runs
    # with the new table, whose shape the traced mod must have (it decides the gathers' checks).
    def biased(table):
        def mod(score, b, h, q_idx, kv_idx):
            return score + table[(q_idx - kv_idx).abs() % table.shape[0]]
        return mod

    q, k, v = qkv()
    f, _ = compiled(lambda q, k, v, m: flex_attention(q, k, v, score_mod=m), mode)
    g = torch.Generator().manual_seed(1)
    tables = [torch.randn(n, generator=g).to(DEVICE) for n in (5, 7, 11, 16)]
    for table in tables:
        assert torch.allclose(f(q, k, v, biased(table)), eager(q, k, v, score_mod=biased(table)), atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_functools_partial_keyword_follows_its_value(mode):
    def base(score, b, h, q_idx, kv_idx, w=0):
        return torch.where(q_idx - kv_idx <= w, score, -score)

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, w: flex_attention(q, k, v, score_mod=functools.partial(base, w=w)), mode)
    assert_follows_every_value(lambda w: f(q, k, v, w), lambda w: eager(q, k, v, score_mod=functools.partial(base, w=w)))
    assert counter.frame_count == len(VALUES)  # a partial's numbers are specialised (docs/compile.md)


def test_a_number_used_in_python_that_dynamo_keeps_symbolic_is_refused_not_stale():
    # math.sqrt(n) of a symbolic n: the trace holds sqrt(first n) as a constant, Dynamo passes the
    # new value. The op traces the mod again; where that cannot follow, it raises: never stale.
    def make(n):
        def mod(score, b, h, q_idx, kv_idx):
            return score / math.sqrt(n)
        return mod

    q, k, v = qkv()
    f, _ = compiled(lambda q, k, v, m: flex_attention(q, k, v, score_mod=m), "dynamic")
    for n in (4, 9, 16):
        try:
            got = f(q, k, v, make(n))
        except InvalidInputError as err:
            assert "Dynamo keeps symbolic" in str(err)
            continue
        assert torch.allclose(got, eager(q, k, v, score_mod=make(n)), atol=1e-6), n


# -- item 2: mod_factory with an int that changes --------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_row_a_mod_factory_number_recompiles_once_per_value(mode):
    @flexattn.mod_factory
    def factory(w):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx - kv_idx <= w, score, -score)
        return mod

    q, k, v = qkv()
    f, counter = compiled(lambda q, k, v, w: flex_attention(q, k, v, score_mod=factory(w)), mode)
    assert_follows_every_value(lambda w: f(q, k, v, w), lambda w: eager(q, k, v, score_mod=factory(w)))
    assert counter.frame_count == len(VALUES)


@pytest.mark.parametrize("mode", MODES)
def test_a_mod_factorys_tensor_of_a_new_length_follows_it(mode):
    @flexattn.mod_factory
    def shifted(offsets):
        def mod(score, b, h, q_idx, kv_idx):
            return score + offsets[q_idx % offsets.shape[0]]
        return mod

    q, k, v = qkv()
    f, _ = compiled(lambda q, k, v, t: flex_attention(q, k, v, score_mod=shifted(t * 2)), mode)
    for n in (3, 5, 8):
        t = torch.arange(n, dtype=torch.float32, device=DEVICE)
        assert torch.allclose(f(q, k, v, t), eager(q, k, v, score_mod=shifted(t * 2)), atol=1e-6)


# -- item 3: bound methods -------------------------------------------------------------------------


class WindowedAttention(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w
        self.slopes = torch.nn.Parameter(torch.rand(2, device=DEVICE))

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= self.w, score, -score) + self.slopes[h] * (kv_idx - q_idx)

    def forward(self, q, k, v):
        return flex_attention(q, k, v, score_mod=self.score_mod)


class PlainScorer:
    def __init__(self, w):
        self.w = w

    def mod(self, score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= self.w, score, -score)


@pytest.mark.parametrize("mode", MODES)
def test_row_an_nn_modules_method_as_score_mod(mode):
    module = WindowedAttention(4)
    q, k, v = qkv()
    f, counter = compiled(module, mode)
    torch._dynamo.utils.counters.clear()

    def run(w):
        module.w = w
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=module.score_mod))
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.frame_count == len(VALUES)  # Dynamo guards an nn.Module's int attribute


@pytest.mark.parametrize("mode", MODES)
def test_a_plain_objects_method_as_score_mod(mode):
    scorer = PlainScorer(4)
    q, k, v = qkv()
    f, _ = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=scorer.mod), mode)
    torch._dynamo.utils.counters.clear()

    def run(w):
        scorer.w = w
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=scorer.mod))
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_methods_gradient_reaches_the_module_compiled_like_eager():
    module = WindowedAttention(6)
    q, k, v = (t.requires_grad_() for t in qkv())
    torch.compile(module, backend="aot_eager", fullgraph=True)(q, k, v).sum().backward()
    compiled_grad = module.slopes.grad.clone()
    module.slopes.grad = None
    module(q, k, v).sum().backward()
    assert torch.allclose(compiled_grad, module.slopes.grad, atol=1e-5)


# -- item 4: transformers generate with left padding ------------------------------------------------


@pytest.mark.parametrize("fullgraph", [False, True])
def test_transformers_generate_with_left_padding_compiles_without_a_break(fullgraph):
    transformers = pytest.importorskip("transformers")
    import flexattn.integrations.transformers as flexattn_hf

    flexattn_hf.register()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flexattn")
    model = model.to(DEVICE)
    ids = torch.randint(1, 128, (2, 12), device=DEVICE)
    padding = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    padding[0, :4] = 0  # left padding
    want = model.generate(ids, attention_mask=padding, max_new_tokens=3, do_sample=False, pad_token_id=0)
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(model.forward, backend="eager", dynamic=True, fullgraph=fullgraph)
    got = model.generate(ids, attention_mask=padding, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3  # sdpa: 2 (prefill, decode)


@pytest.mark.parametrize("mode", MODES)
def test_a_keyword_only_default_follows_its_value(mode):
    def mod(score, b, h, q_idx, kv_idx, *, w=4):
        return torch.where(q_idx - kv_idx <= w, score, -score)

    q, k, v = qkv()
    f, _ = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=mod), mode)

    def run(w):
        mod.__kwdefaults__ = {"w": w}
        return f(q, k, v)

    assert_follows_every_value(run, lambda w: eager(q, k, v, score_mod=mod))
