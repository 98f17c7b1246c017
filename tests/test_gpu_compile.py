"""flexattn inside torch.compile and CUDA graphs on a GPU (issue 21), bf16 at realistic sizes:
reduce-overhead training and decoding steps, a whole training step (forward, backward, AdamW)
captured with torch.cuda.graph and replayed with new inputs, and no host synchronisation in a
compiled step's steady state. GPU only; about a minute on an H100 (mostly Inductor's compiles).

Tolerances follow the flash-attention rule: flexattn's error against a float64 reference is at most
a small multiple of eager PyTorch's own error in the same dtype (see tests/numerics.py)."""

import copy

import pytest
import torch
import torch._dynamo.utils
from numerics import rel_err

from flexattn import create_block_mask, flex_attention, offset_mask_mod

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.slopes = torch.nn.Parameter(torch.exp2(-torch.arange(1, heads + 1, dtype=torch.float32)))
        self.score_mod = learnable_alibi(self)

    def forward(self, x, block_mask):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask)
        return self.proj(y.transpose(1, 2).reshape(B, L, D))


def learnable_alibi(layer):
    def alibi(score, b, h, q_idx, kv_idx):  # learnable: its gradient comes from the fused backward
        return score + layer.slopes[h] * (kv_idx - q_idx)

    return alibi


def twin(model):
    """An independent copy: deepcopy keeps a function as it is, so a copied layer's score_mod would
    still read the original's slopes (its gradient would land there, and its optimizer step be seen)."""
    copied = copy.deepcopy(model)
    for layer in copied.layers:
        layer.score_mod = learnable_alibi(layer)
    return copied


class Model(torch.nn.Module):
    def __init__(self, dim=512, heads=8, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Attention(dim, heads) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))

    def forward(self, x, block_mask):
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x), block_mask)
        return x


def _problem(B=2, L=2048, dim=512):
    torch.manual_seed(0)
    model = Model(dim).to(DEVICE, torch.bfloat16)
    block_mask = create_block_mask(causal, None, None, L, L, device=DEVICE)
    return model, block_mask, B, L, dim


def _loss(model, x, target, block_mask):
    return torch.nn.functional.mse_loss(model(x, block_mask).float(), target.float())


def test_reduce_overhead_training_steps_replay_like_eager():
    model, block_mask, B, L, dim = _problem()
    eager = twin(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    torch._dynamo.utils.counters.clear()
    for step in range(4):  # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(B, L, dim, device=DEVICE, dtype=torch.bfloat16)
        target = torch.randn_like(x)
        loss = _loss(compiled, x, target, block_mask)
        loss.backward()
        want = _loss(eager, x, target, block_mask)
        want.backward()
        assert rel_err(loss, want) < 1e-2, step
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert rel_err(p.grad.float(), q.grad.float()) < 3e-2, (step, name)
            p.grad = q.grad = None
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"], dict(
        torch._dynamo.utils.counters["inductor"])


def test_compiled_steady_state_does_not_synchronise():
    model, block_mask, B, L, dim = _problem()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(B, L, dim, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randn_like(x)
    for _ in range(2):
        _loss(compiled, x, target, block_mask).backward()
    torch.cuda.synchronize()
    new_mask = create_block_mask(causal, None, None, L, L, device=DEVICE)  # a new mask: still no sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        _loss(compiled, x, target, new_mask).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_decoding_step_compiled_with_reduce_overhead():
    B, H, S, D = 4, 16, 4096, 64
    torch.manual_seed(0)
    k = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    full = create_block_mask(causal, 1, 1, S, S, device=DEVICE)

    def step(q, position):
        mask = full[:, :, position // full.BLOCK_SIZE[0]]
        mask.mask_mod = offset_mask_mod(full.mask_mod, position)
        mask.seq_lengths = (1, S)
        return flex_attention(q, k, v, block_mask=mask)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    position = torch.zeros((), dtype=torch.int32, device=DEVICE)
    for pos in (5, 300, 2048, 4095, 17):
        torch.compiler.cudagraph_mark_step_begin()
        q = torch.randn(B, H, 1, D, device=DEVICE, dtype=torch.bfloat16)
        position.fill_(pos)
        got = compiled(q, position).clone()
        assert rel_err(got, step(q, position)) < 1e-2, pos


def test_a_whole_training_step_captured_with_cuda_graph():
    model, block_mask, B, L, dim = _problem()
    eager = twin(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-3, capturable=True)
    static_x = torch.randn(B, L, dim, device=DEVICE, dtype=torch.bfloat16)
    static_target = torch.randn_like(static_x)

    def train_step():
        optimizer.zero_grad(set_to_none=False)
        loss = _loss(model, static_x, static_target, block_mask)
        loss.backward()
        optimizer.step()
        return loss

    # Warm-up on a side stream: tracing, kernel compiles, launch plans and the optimizer's state.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    eager.load_state_dict(model.state_dict())
    # A deep copy: load_state_dict keeps tensors that need no cast, so the two optimizers would share
    # their moments and each replayed step would move them twice.
    eager_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train_step()

    for step in range(3):
        x = torch.randn_like(static_x)
        target = torch.randn_like(static_target)
        static_x.copy_(x)
        static_target.copy_(target)
        graph.replay()
        eager_optimizer.zero_grad()
        want = _loss(eager, x, target, block_mask)
        want.backward()
        eager_optimizer.step()
        torch.cuda.synchronize()
        assert rel_err(static_loss, want) < 1e-2, step
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert rel_err(p.grad.float(), q.grad.float()) < 3e-2, (step, name)
            assert rel_err(p.float(), q.float()) < 1e-2, (step, name)


def test_a_cold_compiled_step_has_its_kernels_compiled_ahead(tmp_path):
    """[Note] Kernels compiled ahead (kernels/ahead.py): a fresh process with empty caches compiles
    a causal block (forward and backward); the Gluon or portable kernels it launches were compiled
    by the worker processes, and the gradients match the same block in eager mode."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), FLEXATTN_CACHE_DIR=str(tmp_path / "flexattn"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), FLEXATTN_DEBUG="1", FLEXATTN_COMPILE_WORKERS="2")
    env.pop("TRITON_INTERPRET", None)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", "import test_gpu_compile as t; t.cold_block_step()"], env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    ahead = [line for line in done.stderr.splitlines() if " ahead in " in line]
    assert any("forward" in line for line in ahead) and any("backward" in line for line in ahead), done.stderr[-3000:]
    assert "close" in done.stdout


def cold_block_step():
    torch.manual_seed(0)
    B, H, L, E = 2, 4, 2048, 64
    block_mask = create_block_mask(causal, None, None, L, L, device=DEVICE)

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask)

    leaves = [torch.randn(B, H, L, E, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    grad = torch.randn(B, H, L, E, device=DEVICE, dtype=torch.bfloat16)
    compiled = torch.compile(attend, fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves, grad)
    want = torch.autograd.grad(attend(*leaves), leaves, grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-2
    print("close")


def test_compiled_steps_follow_learnt_slopes_and_a_mask_changed_in_place():
    # [Note] Warm calls of the forward op (compile/warm.py): after the first call of a problem, the op
    # launches the kept plan. Each step's optimizer changes the slopes the score_mod reads (new
    # contents, same tensor); then the mask's tables are changed in place. Against eager each time.
    model, block_mask, B, L, dim = _problem()
    eager = twin(model)
    compiled = torch.compile(model, fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, eager)]
    for step in range(4):
        if step == 3:  # query block 5 loses its full blocks: the checked row statistics no longer hold
            block_mask.full_kv_num_blocks[:, :, 5] = 0
        x = torch.randn(B, L, dim, device=DEVICE, dtype=torch.bfloat16)
        target = torch.randn_like(x)
        with torch.no_grad():
            assert rel_err(compiled(x, block_mask), eager(x, block_mask)) < 1e-2, step
        for m, optimizer in zip((model, eager), optimizers):
            _loss(m, x, target, block_mask).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert rel_err(model.layers[0].slopes.float(), eager.layers[0].slopes.float()) < 1e-2, step


def test_serving_under_inference_mode_eager_and_compiled():
    # Serving code runs under torch.inference_mode, where a mask's tables are inference tensors
    # without version counters: this once raised. Eager and compiled calls, a table changed in place
    # there, against the PyTorch backend in float64 on the same tables.
    compiled = torch.compile(flex_attention, fullgraph=True)
    with torch.inference_mode():
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 8, 2048, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        mask = create_block_mask(causal, None, None, 2048, 2048, device=DEVICE)

        def reference():
            return flex_attention(q.double(), k.double(), v.double(), block_mask=mask,
                                  kernel_options={"BACKEND": "PYTORCH"}).float()

        expected = reference()
        for _ in range(3):
            assert rel_err(flex_attention(q, k, v, block_mask=mask).float(), expected) < 1e-2
            assert rel_err(compiled(q, k, v, block_mask=mask).float(), expected) < 1e-2
        mask.full_kv_num_blocks[:, :, 7] = 0  # query block 7 drops its full blocks
        expected_now = reference()
        assert rel_err(expected_now, expected) > 1e-2  # the change shows in the result
        assert rel_err(flex_attention(q, k, v, block_mask=mask).float(), expected_now) < 1e-2
        assert rel_err(compiled(q, k, v, block_mask=mask).float(), expected_now) < 1e-2
        # The compiled call captured in a CUDA graph (its tables' shape was checked above: nothing
        # is read back in the capture), replayed with new queries.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(q, k, v, block_mask=mask)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = compiled(q, k, v, block_mask=mask)
        q.copy_(torch.randn_like(q))
        graph.replay()
        assert rel_err(static.float(), reference()) < 1e-2


@pytest.mark.parametrize("options", [{}, {"BACKEND": "TRITON"}], ids=["auto", "portable"])
def test_reduce_overhead_from_a_problems_first_call(monkeypatch, options):
    # The first call of a problem makes its warm launch (compile.py, [Note] Warm calls of the forward
    # op) inside cudagraph trees' warm-up, whose allocations come from the graph's pool: the launch
    # must keep none of them (a kept output sample once failed with "Detected 1 tensor(s) in the
    # cudagraph pool not tracked as outputs"). Large enough for tensor descriptors (the Gluon forward
    # on sm90, host descriptors in the portable one). Then the warm calls follow new inputs.
    import gc
    import weakref

    import flexattn.compile.warm as warm_module

    monkeypatch.setattr(warm_module, "_WARM", {})
    torch.manual_seed(0)
    B, H, L, D = 2, 8, 8192, 64
    mask = create_block_mask(causal, None, None, L, L, device=DEVICE)

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=mask, kernel_options=options)

    compiled = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        q, k, v = (torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        got = compiled(q, k, v).float()
        want = flex_attention(q.double(), k.double(), v.double(), block_mask=mask,
                              kernel_options={"BACKEND": "PYTORCH"}).float()
        assert rel_err(got, want) < 1e-2, step
    assert warm_module._WARM, "the op never kept a warm launch"
    # Default mode: the op gets the caller's tensors, and keeps none of them.
    compiled = torch.compile(attend, fullgraph=True)
    q, k, v = (torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        out = compiled(q, k, v)
    # Eager and compiled calls walk this mask with three consumers (kernels/hopper/forward.py [Note] Programs
    # across query blocks), the warm-up and the capture above with two: the same attention summed in
    # another order, within bf16's error.
    want = flex_attention(q.double(), k.double(), v.double(), block_mask=mask, kernel_options={"BACKEND": "PYTORCH"})
    assert rel_err(out.float(), want.float()) < 1e-2
    assert rel_err(out.float(), attend(q, k, v).float()) < 5e-3
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


def softcap_score(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


@pytest.mark.parametrize("options", [{}, {"DETERMINISTIC": True}, {"BACKEND": "TRITON"}],
                         ids=["auto", "deterministic", "portable"])
@pytest.mark.parametrize("score_mod", [None, softcap_score], ids=["causal", "softcap"])
def test_warm_backward_calls_match_the_long_way(monkeypatch, options, score_mod):
    # compile.py, [Note] Warm calls of the backward op: after a problem's first backward, later ones
    # launch the kept launches with new inputs. Their gradients against the eager call's on the same
    # inputs (the same kernels: equal where every output row has one writer; dQ added by the copy
    # engine in AUTO's Gluon dK/dV kernel differs in the order of its sums) and against float64. Both
    # Gluon forms (fused dQ, and the deterministic two kernels) and the portable backward.
    import gc
    import weakref

    import flexattn.compile.warm as warm_module

    monkeypatch.setattr(warm_module, "_WARM_BACKWARD", {})
    warm_runs = []
    real_run = warm_module._WarmBackward.run
    monkeypatch.setattr(warm_module._WarmBackward, "run", lambda self, *a: warm_runs.append(1) or real_run(self, *a))
    torch.manual_seed(0)
    B, H, L, D = 2, 8, 4096, 64
    mask = create_block_mask(causal, None, None, L, L, device=DEVICE)

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, kernel_options=options)

    compiled = torch.compile(attend, fullgraph=True)
    exact = bool(options)  # no atomics
    for step in range(4):
        q, k, v = (torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, L, D, device=DEVICE, dtype=torch.bfloat16)
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v), dout)
        eager = torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
        for name, g, e in zip("qkv", got, eager):
            assert torch.equal(g, e) if exact else rel_err(g.float(), e.float()) < 1e-3, (step, name)
        if step == 3:
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            want = torch.autograd.grad(
                flex_attention(q64, k64, v64, score_mod=score_mod, block_mask=mask,
                               kernel_options={"BACKEND": "PYTORCH"}), (q64, k64, v64), dout.double())
            for name, g, w in zip("qkv", got, want):
                assert rel_err(g.float(), w.float()) < 2e-2, name
    assert len(warm_module._WARM_BACKWARD) == 1 and len(warm_runs) == 3
    refs = [weakref.ref(t) for t in (q, k, v, dout, *got)]
    del q, k, v, dout, got, eager, g, e, w  # the loops' names hold the last gradients too
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
