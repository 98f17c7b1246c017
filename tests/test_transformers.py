"""flexattn as transformers' attention implementation "flexattn" (issue 21): tiny random-weight
models, no downloads. Logits and gradients against transformers' own implementations, eager and
compiled, and greedy generation."""

import pytest
import torch
import torch._dynamo.utils

transformers = pytest.importorskip("transformers")

from numerics import rel_err  # noqa: E402

import flexattn.integrations.transformers as flexattn_hf  # noqa: E402

SEQ = 64


@pytest.fixture(scope="module", autouse=True)
def _registered():
    flexattn_hf.register()


def llama(attn_implementation):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def gemma2(attn_implementation):
    # Soft-capped logits and a sliding window shorter than the sequence on every other layer.
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, max_position_embeddings=256, attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0, sliding_window=16, query_pre_attn_scalar=16,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


MODELS = {"llama": (llama, "sdpa"), "gemma2": (gemma2, "eager")}


def logits_and_grads(model, ids, compile_backend=None):
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    out = run(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.logits.detach(), grads


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_match_transformers(name, one_thread):
    make, theirs = MODELS[name]
    ids = torch.randint(0, 128, (2, SEQ))
    want_logits, want_grads = logits_and_grads(make(theirs), ids)
    logits, grads = logits_and_grads(make("flexattn"), ids)
    assert rel_err(logits, want_logits) < 1e-4
    assert grads.keys() == want_grads.keys()
    for key in grads:
        assert rel_err(grads[key], want_grads[key]) < 1e-3, key


@pytest.mark.parametrize("name", MODELS)
def test_compiled_model_matches_eager_without_a_break_at_the_attention(name, one_thread):
    torch._dynamo.reset()
    make, _ = MODELS[name]
    ids = torch.randint(0, 128, (2, SEQ))
    model = make("flexattn")
    want_logits, want_grads = logits_and_grads(model, ids)
    logits, grads = logits_and_grads(model, ids, compile_backend="aot_eager")
    assert rel_err(logits, want_logits) < 1e-5
    for key in grads:
        assert rel_err(grads[key], want_grads[key]) < 1e-4, key
    explained = torch._dynamo.explain(model)(input_ids=ids)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_generation_matches_transformers(one_thread):
    ids = torch.randint(0, 128, (1, 12))
    want = llama("sdpa").generate(ids, max_new_tokens=6, do_sample=False)
    got = llama("flexattn").generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_padding_and_sinks():
    # A left-padded batch (padding through the mask) and attention sinks (s_aux, through the LSE).
    model = llama("flexattn")
    reference = llama("sdpa")
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    got = model(input_ids=ids, attention_mask=mask).logits
    want = reference(input_ids=ids, attention_mask=mask).logits
    assert rel_err(got[1], want[1]) < 1e-4 and rel_err(got[0, 5:], want[0, 5:]) < 1e-4
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    sinks = torch.randn(4)
    out, lse = flexattn_hf.attention_forward(torch.nn.Module(), q, k, v, None, s_aux=sinks)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 8 ** 0.5
    weights = torch.softmax(torch.cat([scores, sinks.view(1, 4, 1, 1).expand(1, 4, 16, 1)], -1), -1)[..., :-1]
    assert rel_err(out, torch.einsum("bhqk,bhkd->bqhd", weights, v)) < 1e-5 and lse.shape == (1, 4, 16)


def test_compiled_generation_matches_eager_without_a_break(one_thread):
    # Each step's mask is built in the graph (torch's builder) over offsets the mods read as tensors.
    torch._dynamo.reset()
    model = llama("flexattn")
    ids = torch.randint(0, 128, (1, 12))
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(model.forward, backend="eager", dynamic=True)  # Dynamo's part: the breaks
    got = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
