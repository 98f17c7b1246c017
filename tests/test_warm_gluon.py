"""[Note] The Gluon forward's choice, kept (dispatch.py), without a GPU: warm eager calls ask the
Hopper Gluon forward's reasons once per key, and every fact the key stands for, changed after warm
calls, gives the answer a fresh choice gives; the same for the backward's choice; and the Gluon
forward's prepared launches ([Note] Prepared Gluon forward launches) launch what the long way would.

The Gluon path runs on CPU tensors here as on a Hopper: the problem's reasons (kernels/hopper/forward.py
``problem_reason``) are replaced by a counting stand-in that asks the real shape rules
(hopper/common.py ``shape_reason``) and a per-device table in place of the device's facts, and the
Gluon kernel is recorded, not launched (Gluon kernels do not run in Triton's interpreter).
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from test_hopper_backward import _Recorder

import flexattn.dispatch as dispatch
import flexattn.kernels.hopper.backward as hopper_backward
import flexattn.kernels.hopper.common as hopper_common
import flexattn.kernels.hopper.forward as hopper_forward
from flexattn import create_block_mask
from flexattn.dispatch import Call
from flexattn.kernels.family import CompiledKernel
from flexattn.trace import trace_mod

L = 256
slopes = torch.exp2(-torch.arange(1, 3, dtype=torch.float32))


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / 20.0) * 20.0


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def anti_causal(b, h, q_idx, kv_idx):
    return q_idx <= kv_idx


def bhnd(N=L, D=128, dtype=torch.bfloat16, H=2, B=1):
    return torch.randn(B, H, N, D, dtype=dtype)


@pytest.fixture
def gluon(monkeypatch):
    """The Gluon forward as on a Hopper, its problem reasons counted, its launches recorded."""
    state = SimpleNamespace(reasons=0, launches=[], devices={"cpu": None})

    def problem_reason(q, k, v, block_mask, need_max):
        state.reasons += 1
        return state.devices[q.device.type] or hopper_common.shape_reason(q, k, v, block_mask, need_max)

    monkeypatch.setattr(hopper_forward, "problem_reason", problem_reason)
    monkeypatch.setattr(CompiledKernel, "kernel", lambda self, params: _Recorder(params, state.launches))
    monkeypatch.setattr(dispatch, "_GLUON_FORWARD", {})
    # Fresh families: a prepared launch keeps the kernel it launches (here another test's recorder).
    monkeypatch.setattr(hopper_forward, "_kernels", OrderedDict())
    return state


def call_of(block_mask, score_mod=alibi, options=None) -> Call:
    score = trace_mod(score_mod, "score_mod")[0] if score_mod is not None else None
    mask = trace_mod(block_mask.mask_mod, "mask_mod")[0]
    return Call("TRITON", block_mask, 0.125, score, mask, [], options or {}, torch.int32)


def forward(call: Call, q, k, v, captured=None, need_max=False):
    """``(took the Gluon forward, note)`` of dispatch's eager Gluon step."""
    captured = [slopes] if captured is None and call.score is not None else captured or []
    result, note = dispatch._sm90_forward(call, q, k, v, captured, True, need_max)
    return result is not None, note


def test_warm_calls_ask_the_reasons_once(gluon):
    q, k, v = bhnd(), bhnd(), bhnd()
    call = call_of(create_block_mask(causal, None, None, L, L, device="cpu"))
    for _ in range(5):
        assert forward(call, q, k, v) == (True, "")
    assert gluon.reasons == 1 and len(gluon.launches) == 5
    assert dispatch.sm90_forward_choice(call, q, k, v, False)[1] is None  # the uncached choice agrees
    assert gluon.reasons == 2


def _misaligned(t: torch.Tensor) -> None:
    """``t`` (the same object, so the same id()) moved onto storage 2 bytes off 16-byte alignment."""
    base = torch.empty(t.numel() + 8, dtype=t.dtype)
    t.set_(base.untyped_storage(), 1, t.shape, t.stride())


def _strided(t: torch.Tensor) -> None:
    """``t`` (the same object) on storage whose last dim is not contiguous."""
    base = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    t.set_(base.untyped_storage(), 0, t.shape, base[..., ::2].stride())


# Each change after warm calls: what it does to (call, q, k, v, need_max), and what a fresh choice says.
CHANGES = {
    "float32 query": (lambda s: setattr(s.q, "data", s.q.data.float()), "float16 or bfloat16"),
    "float16 everywhere": (lambda s: [setattr(t, "data", t.data.half()) for t in (s.q, s.k, s.v)], ""),
    "float16 key only": (lambda s: setattr(s.k, "data", s.k.data.half()), "float16 or bfloat16"),
    "float16 value only": (lambda s: setattr(s.v, "data", s.v.data.half()), "float16 or bfloat16"),
    "head dim 96": (lambda s: [setattr(t, "data", bhnd(D=96)) for t in (s.q, s.k, s.v)], "head dims of 64 or 128"),
    # Views of the same strides: only the shape tells them apart.
    "value head dim 64, same strides": (lambda s: setattr(s.v, "data", s.v.data[..., :64]),
                                        "equal Q/K and V head dims"),
    "shorter query, same strides": (lambda s: setattr(s.q, "data", s.q.data[:, :, :200]), "multiples of 128"),
    "shorter key, same strides": (lambda s: setattr(s.k, "data", s.k.data[:, :, :200]), "multiples of 128"),
    "head dim 64": (lambda s: [setattr(t, "data", bhnd(D=64)) for t in (s.q, s.k, s.v)],
                    "portable forward is faster with a score_mod and a mask_mod"),
    "lengths of 200": (lambda s: [setattr(t, "data", bhnd(N=200)) for t in (s.q, s.k, s.v)]
                       or setattr(s, "call", call_of(create_block_mask(causal, None, None, 200, 200, device="cpu"))),
                       "multiples of 128"),
    "misaligned query, same id": (lambda s: _misaligned(s.q), "q cannot be read"),
    "misaligned key, same id": (lambda s: _misaligned(s.k), "k cannot be read"),
    "misaligned value, same id": (lambda s: _misaligned(s.v), "v cannot be read"),
    # The same shape: only the strides tell them apart.
    "strided query, same id": (lambda s: _strided(s.q), "q cannot be read"),
    "strided key, same id": (lambda s: _strided(s.k), "k cannot be read"),
    "strided value, same id": (lambda s: _strided(s.v), "v cannot be read"),
    "BLOCK_SIZE 64": (lambda s: setattr(s, "call", call_of(create_block_mask(causal, None, None, L, L, device="cpu",
                                                                             BLOCK_SIZE=64))), "BLOCK_SIZE"),
    "max_scores": (lambda s: setattr(s, "need_max", True), "does not write max_scores"),
    "another device": (lambda s: s.__dict__.update(q=s.q.to("meta"), k=s.k.to("meta"), v=s.v.to("meta")),
                       "this GPU is 8.0"),
    "BACKEND='TRITON'": (lambda s: setattr(s, "call", s.call._replace(options={"BACKEND": "TRITON"})),
                         "pins the portable kernels"),
    "a portable tile option": (lambda s: setattr(s, "call", s.call._replace(options={"BLOCK_M": 64})),
                               "tune the portable forward"),
    "another score_mod": (lambda s: setattr(s, "call", call_of(s.call.block_mask, softcap)), ""),
    "no score_mod": (lambda s: setattr(s, "call", call_of(s.call.block_mask, None)), ""),
    "another mask_mod": (lambda s: setattr(s, "call", call_of(create_block_mask(anti_causal, None, None, L, L,
                                                                                device="cpu"))), ""),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_fact_is_not_answered_from_a_stale_choice(gluon, change):
    gluon.devices["meta"] = "the Gluon kernel is for compute capability 9.0 (Hopper), this GPU is 8.0"
    s = SimpleNamespace(q=bhnd(), k=bhnd(), v=bhnd(), need_max=False,
                        call=call_of(create_block_mask(causal, None, None, L, L, device="cpu")))
    for _ in range(3):
        assert forward(s.call, s.q, s.k, s.v, need_max=s.need_max) == (True, "")
    alter, expected = CHANGES[change]
    alter(s)
    took, note = forward(s.call, s.q, s.k, s.v, need_max=s.need_max)
    fresh = dispatch.sm90_forward_choice(s.call, s.q, s.k, s.v, s.need_max)
    assert took == (fresh[0] is not None and fresh[1] is None)
    assert took == (expected == "") and expected in note, note
    if took:  # the family of the call's own mods launched
        kernel = dispatch._kept_forward_choice(s.call, s.q, s.k, s.v, s.need_max)[0]
        assert kernel.score is s.call.score and kernel.mask is s.call.mask


def test_the_launch_reads_each_calls_captured_tensor(gluon):
    q, k, v = bhnd(), bhnd(), bhnd()
    call = call_of(create_block_mask(causal, None, None, L, L, device="cpu"))
    for values in ([slopes], [slopes.clone()], [torch.zeros(2)]):
        assert forward(call, q, k, v, captured=values) == (True, "")
        assert any(a is values[0] for a in gluon.launches[-1][2])
    assert gluon.reasons == 1


def test_a_family_whose_kernels_did_not_compile_falls_back_at_the_next_call(gluon):
    q, k, v = bhnd(), bhnd(), bhnd()
    call = call_of(create_block_mask(causal, None, None, L, L, device="cpu"))
    assert forward(call, q, k, v) == (True, "")
    kernel = dispatch.sm90_forward_choice(call, q, k, v, False)[0]
    kernel._failed[kernel._variants(q, k)] = "the Gluon kernel of these mods did not compile (x)"
    try:
        assert forward(call, q, k, v) == (False, "not GLUON (the Gluon kernel of these mods did not compile (x)); ")
    finally:
        kernel._failed.clear()


def test_auto_rule_reads_each_calls_mask(gluon):
    # At head dim 64 AUTO leaves rows of few key blocks to the portable forward: two masks of one
    # mask_mod's graph (one key) whose rows visit 24 and 2 key blocks take different forwards.
    N = 24 * 128

    def window(size):
        def near(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() <= size
        return near

    wide, narrow = (create_block_mask(window(w), None, None, N, N, device="cpu") for w in (N, 64))
    assert trace_mod(wide.mask_mod, "mask_mod")[0] is trace_mod(narrow.mask_mod, "mask_mod")[0]
    q, k, v = (bhnd(N=N, D=64, H=1) for _ in range(3))
    for _ in range(2):
        assert forward(call_of(wide, None), q, k, v) == (True, "")
        took, note = forward(call_of(narrow, None), q, k, v)
        assert not took and "rows of few key blocks" in note
    assert gluon.reasons == 1


# ------------------------------------------------------------------------------------ prepared launches
# [Note] Prepared Gluon forward launches (kernels/hopper/forward.py): after warm calls of one family,
# a call with one thing changed that its key leaves out launches what a fresh family's long way
# launches for that call (the same grid, constexprs and arguments: the call's own tensors, the
# outputs fresh allocations of the same layout).


def _normal(value, inputs: list):
    """A launch argument as the comparison sees it: the call's own tensors by position in ``inputs``,
    other tensors (fresh outputs) by layout, descriptors by tensor and geometry, floats by repr
    (0.0 and -0.0 differ)."""
    if isinstance(value, torch.Tensor):
        same = [i for i, t in enumerate(inputs) if t is value]
        return ("input", same[0]) if same else ("fresh", tuple(value.shape), value.stride(), value.dtype)
    if hasattr(value, "block_shape"):
        return ("descriptor", _normal(value.base, inputs), tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), repr(value.layout))
    return repr(value) if isinstance(value, float) else value


def _launch_of(record, inputs: list) -> tuple:
    params, grid, args, constexprs = record
    return params.name, tuple(grid), tuple(_normal(a, inputs) for a in args), dict(constexprs)


@pytest.fixture
def families(monkeypatch):
    """Two families of ALiBi + causal (one warmed up, one fresh), their launches recorded."""
    calls = []
    monkeypatch.setattr(CompiledKernel, "kernel", lambda self, params: _Recorder(params, calls))
    score = trace_mod(alibi, "score_mod")[0]
    mask = trace_mod(causal, "mask_mod")[0]
    return SimpleNamespace(calls=calls, new=lambda: hopper_forward.HopperForwardKernel(score, mask, tanh_approx=False))


def _widened(bm):
    """``bm`` with index tables twice as wide (zero columns past every row's count): the same row
    table and statistics, so the same plan key."""
    from flexattn import BlockMask

    pad = torch.zeros_like(bm.kv_indices)
    return BlockMask.from_kv_blocks(bm.kv_num_blocks, torch.cat([bm.kv_indices, pad], -1), bm.full_kv_num_blocks,
                                    torch.cat([bm.full_kv_indices, pad], -1), BLOCK_SIZE=bm.BLOCK_SIZE,
                                    mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)


def _in_place(bm):
    """``bm`` itself, its tables overwritten with another mask's (same shapes and statistics)."""
    other = create_block_mask(anti_causal, None, None, L, L, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(other, name))
    return bm


def _fresh_inputs(s):
    """New q, k and v of the same layout, the old ones freed (their ids may come back)."""
    s.q = s.k = s.v = None
    import gc

    gc.collect()
    s.q, s.k, s.v = bhnd(), bhnd(), bhnd()


# Each change after warm calls, on the state (q, k, v, bm, scale, captured); and the warm-up's scale.
PREPARED_CHANGES = {
    "a scale of the same sign": (0.125, lambda s: setattr(s, "scale", 0.25)),
    "-0.0 after 0.0": (0.0, lambda s: setattr(s, "scale", -0.0)),
    "wider index tables": (0.125, lambda s: setattr(s, "bm", _widened(s.bm))),
    "tables changed in place": (0.125, lambda s: setattr(s, "bm", _in_place(s.bm))),
    "the mod's tensor replaced": (0.125, lambda s: setattr(s, "captured", [slopes.clone() * 2])),
    "freed tensors, new ones": (0.125, _fresh_inputs),
    "heads side by side in a row": (0.125, lambda s: setattr(s, "q", torch.randn(1, L, 2, 128, dtype=torch.bfloat16)
                                                               .transpose(1, 2))),
}


@pytest.mark.parametrize("change", sorted(PREPARED_CHANGES))
def test_a_prepared_gluon_launch_launches_what_the_long_way_would(families, change):
    warm_scale, alter = PREPARED_CHANGES[change]
    s = SimpleNamespace(q=bhnd(), k=bhnd(), v=bhnd(), bm=create_block_mask(causal, None, None, L, L, device="cpu"),
                        scale=warm_scale, captured=[slopes])
    warm = families.new()
    for _ in range(3):
        warm(s.q, s.k, s.v, s.bm, s.scale, s.captured, [], need_lse=True)
    assert warm.prepared_calls == 2  # the first call took the long way, and prepared the next ones
    alter(s)
    from flexattn.kernels.tables import launch_tables

    def launched(family):
        out, lse = family(s.q, s.k, s.v, s.bm, s.scale, s.captured, [], need_lse=True)
        assert out.shape == s.q.shape and lse.shape == s.q.shape[:3]
        inputs = [s.q, s.k, s.v, *launch_tables(s.bm)[:4], *s.captured]
        return _launch_of(families.calls[-1], inputs)

    assert launched(warm) == launched(families.new())


def test_a_replaced_gluon_plan_is_launched_not_the_prepared_one(families):
    q, k, v = bhnd(), bhnd(), bhnd()
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    kernel = families.new()
    for _ in range(2):
        kernel(q, k, v, bm, 0.125, [slopes], [], need_lse=True)
    [(key, plan)] = kernel._plans.items()
    kernel._plans[key] = other = plan.with_constexprs("forward", STAGES=3)
    kernel(q, k, v, bm, 0.125, [slopes], [], need_lse=True)
    assert families.calls[-1][3]["STAGES"] == 3 and kernel.last_plan is other


def test_an_unaligned_input_takes_the_long_way_which_refuses_it(families):
    q, k, v = bhnd(), bhnd(), bhnd()
    bm = create_block_mask(causal, None, None, L, L, device="cpu")
    kernel = families.new()
    for _ in range(2):
        kernel(q, k, v, bm, 0.125, [slopes], [], need_lse=True)
    served = kernel.prepared_calls
    _misaligned(k)  # same shape and strides: the same plan key
    with pytest.raises(AssertionError, match="16-byte aligned"):
        kernel(q, k, v, bm, 0.125, [slopes], [], need_lse=True)
    assert kernel.prepared_calls == served


# ------------------------------------------------------------------------------------ the backward's choice
# Kept as the forward's is (dispatch._GLUON_BACKWARD): its problem reasons (the shared rules, counted,
# with a device table as above) asked once per key, and every fact its key stands for, changed after
# warm calls, answered as the uncached sm90_backward_choice answers.


@pytest.fixture
def gluon_backward(monkeypatch):
    state = SimpleNamespace(reasons=0, devices={"cpu": None, "meta": "this GPU is 8.0"})

    def common_problem_reason(q, k, v, block_mask, need_max):
        state.reasons += 1
        return state.devices[q.device.type] or hopper_common.shape_reason(q, k, v, block_mask, need_max)

    monkeypatch.setattr(hopper_backward, "common_problem_reason", common_problem_reason)
    monkeypatch.setattr(dispatch, "_GLUON_BACKWARD", {})
    monkeypatch.setattr(hopper_backward, "_kernels", OrderedDict())
    return state


learnable = torch.randn(2, requires_grad=True)


def learnt_bias(score, b, h, q_idx, kv_idx):
    return score + learnable[h]


BACKWARD_CHANGES = {
    "float32 parts of dK and dV": (lambda s: setattr(s, "f32", True), "float32 parts"),
    "no output gradient given": (lambda s: setattr(s, "grad_out", None), ""),
    "float16 output gradient": (lambda s: setattr(s.grad_out, "data", s.grad_out.data.half()), "output's gradient"),
    "misaligned output gradient, same id": (lambda s: _misaligned(s.grad_out), "output's gradient"),
    "strided output gradient, same id": (lambda s: _strided(s.grad_out), "output's gradient"),
    "a broadcast key/value batch": (lambda s: [setattr(t, "data", t.data[:1]) for t in (s.k, s.v)], "broadcast"),
    "float32 query": (lambda s: setattr(s.q, "data", s.q.data.float()), "float16 or bfloat16"),
    "misaligned key, same id": (lambda s: _misaligned(s.k), "k cannot be read"),
    "strided value, same id": (lambda s: _strided(s.v), "v cannot be read"),
    "another device": (lambda s: s.__dict__.update(q=s.q.to("meta"), k=s.k.to("meta"), v=s.v.to("meta"),
                                                    grad_out=s.grad_out.to("meta")), "this GPU is 8.0"),
    "BLOCK_SIZE 64": (lambda s: setattr(s, "call", call_of(create_block_mask(causal, None, None, L, L, device="cpu",
                                                                             BLOCK_SIZE=64))), "BLOCK_SIZE"),
    "a portable tile option": (lambda s: setattr(s, "call", s.call._replace(options={"BLOCK_M1": 32})),
                               "tune the portable backward"),
    "a learnable captured tensor": (lambda s: setattr(s, "call", call_of(s.call.block_mask, learnt_bias)),
                                    "learnable biases"),
    "another mask_mod": (lambda s: setattr(s, "call", call_of(create_block_mask(anti_causal, None, None, L, L,
                                                                                device="cpu"))), ""),
}


def _backward_state():
    B = 2
    return SimpleNamespace(q=bhnd(B=B), k=bhnd(B=B), v=bhnd(B=B), grad_out=bhnd(B=B), f32=False,
                           call=call_of(create_block_mask(causal, None, None, L, L, device="cpu")))


@pytest.mark.parametrize("change", sorted(BACKWARD_CHANGES))
def test_a_changed_fact_is_not_answered_from_a_stale_backward_choice(gluon_backward, change):
    s = _backward_state()
    for _ in range(3):
        kernel, reason = dispatch._kept_backward_choice(s.call, s.q, s.k, s.v, s.f32, s.grad_out)
        assert kernel is not None and reason is None
    assert gluon_backward.reasons == 1
    alter, expected = BACKWARD_CHANGES[change]
    alter(s)
    kernel, reason = dispatch._kept_backward_choice(s.call, s.q, s.k, s.v, s.f32, s.grad_out)
    assert (kernel, reason) == dispatch.sm90_backward_choice(s.call, s.q, s.k, s.v, s.f32, s.grad_out)
    assert (reason is None) == (expected == "") and expected in (reason or ""), reason
    if reason is None:
        assert kernel.score is s.call.score and kernel.mask is s.call.mask


def test_warm_backwards_ask_the_reasons_once_and_a_failed_family_at_each_call(gluon_backward, monkeypatch):
    s = _backward_state()
    grads = (s.q, s.k, s.v, [None])
    monkeypatch.setattr(hopper_backward.HopperBackwardKernel, "__call__", lambda self, *args, **kwargs: grads)
    lse = torch.zeros(s.q.shape[:3])
    for _ in range(3):
        result = dispatch._sm90_backward(s.call, s.q, s.k, s.v, s.q, lse, s.grad_out, None, [slopes], False)
        assert result == (grads, "")
    assert gluon_backward.reasons == 1
    kernel = dispatch._kept_backward_choice(s.call, s.q, s.k, s.v, False, s.grad_out)[0]
    kernel._failed[kernel._variants(s.q, s.k)] = "the Gluon backward of these mods did not compile (x)"
    result, note = dispatch._sm90_backward(s.call, s.q, s.k, s.v, s.q, lse, s.grad_out, None, [slopes], False)
    assert result is None and "did not compile (x)" in note


@pytest.mark.parametrize("change", sorted(set(CHANGES) - {"max_scores"}))
def test_the_forwards_changes_are_not_answered_from_a_stale_backward_choice(gluon_backward, change):
    # The rules the two directions share (hopper/common.py), changed as for the forward: the kept
    # backward choice answers as the uncached one does.
    gluon_backward.devices["meta"] = "this GPU is 8.0"
    s = _backward_state()
    s.need_max = False
    for _ in range(2):
        assert dispatch._kept_backward_choice(s.call, s.q, s.k, s.v, False, s.grad_out)[1] is None
    CHANGES[change][0](s)
    kept = dispatch._kept_backward_choice(s.call, s.q, s.k, s.v, False, s.grad_out)
    assert kept == dispatch.sm90_backward_choice(s.call, s.q, s.k, s.v, False, s.grad_out)
