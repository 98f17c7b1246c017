"""examples/titan_block.py (issue 21): torchtitan-style compiled blocks with a dict of BlockMasks
(causal, document, sliding window) and activation checkpointing, full and selective."""

import importlib.util
from pathlib import Path

import pytest
import torch

import flexattn.compile.ops

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "titan_block.py"


@pytest.fixture(scope="module")
def titan():
    spec = importlib.util.spec_from_file_location("titan_block", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh(one_thread):
    torch._dynamo.reset()
    saved = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    yield
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = saved
    torch._dynamo.reset()


@pytest.mark.parametrize("mode, forwards", [("none", 3), ("full", 6), ("selective", 3)])
def test_compiled_checkpointed_blocks_match_eager(titan, monkeypatch, mode, forwards):
    # forwards: flex_attention forward runs in one step of 3 layers; selective checkpointing saves
    # the attention's outputs, so the backward does not run it again, where full checkpointing does.
    titan._BACKEND = "aot_eager"
    torch.manual_seed(0)
    model = titan.Model(64, 32, 2, 3)
    eager = titan.Model(64, 32, 2, 3)
    eager.load_state_dict(model.state_dict())
    titan.apply_compile_and_checkpointing(model, mode)
    calls = []
    run_forward = flexattn.compile.ops._forward
    monkeypatch.setattr(flexattn.compile.ops, "_forward", lambda *args: calls.append(1) or run_forward(*args))
    generator = torch.Generator().manual_seed(1)
    for step in range(2):  # the second step's masks are new objects over new document ids: no recompile
        tokens, document_ids = titan.batch(2, 128, 64, "cpu", generator)
        masks = titan.block_masks(document_ids, 32)
        want = titan.loss_of(eager, tokens, masks)
        want.backward()
        calls.clear()
        loss = titan.loss_of(model, tokens, masks)
        loss.backward()
        assert len(calls) == forwards
        assert abs(loss.item() - want.item()) < 1e-5
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4)
            p.grad = q.grad = None


def test_the_example_runs_as_a_script(titan):
    assert titan.main(["--checkpointing", "selective", "--backend", "aot_eager", "--steps", "2", "--seq", "128"]) == 0
