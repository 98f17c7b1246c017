"""The deterministic backward: learnable captured tensors' gradients summed in a fixed order.

dQ, dK and dV are written by one program each, so they never depend on scheduling; the gradients of
learnable captured tensors are the part that does. With ``kernel_options={"DETERMINISTIC": True}``
or ``torch.use_deterministic_algorithms(True)``, each dK/dV program adds into its own float32 slot
and the launcher sums the slots in order (see [Note] Deterministic gradients in
templates/backward.py.jinja). Triton's interpreter runs programs one at a time, so it cannot show
a race; these tests check that the deterministic kernels are the ones that ran and that every
address pattern (one element, per query, per key, per pair, with pairs of one tile meeting at an
element) gives the float64 reference's gradients. tests/test_gpu_backward.py runs them twice on a
GPU and compares the bits.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_backward import DEVICE, check_grads, learnable_alibi, qkv_leaves, randn

import flexattn.kernels.backward as backward
from flexattn.variants import CATALOGUE, causal_mask

DETERMINISTIC = {"BACKEND": "TRITON", "DETERMINISTIC": True}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def slot_calls(monkeypatch):
    """The (programs, slot size) of each deterministic dK/dV launch."""
    calls = []
    real = backward.gradient_slots

    def recording(programs, numel, device):
        calls.append((programs, numel))
        return real(programs, numel, device)

    monkeypatch.setattr(backward, "gradient_slots", recording)
    return calls


def rel_bias_case(H=2, L=80, S=112, B=2, divide=1):
    """A relative-position bias read at ``(q_idx - kv_idx) // divide``: one element per pair, many of
    a tile's pairs meeting at each (more with ``divide`` > 1)."""
    leaves = {**qkv_leaves(B, H, H, L, S, 32), "bias": randn(H, L + S)}

    def build(t):
        bias = t["bias"]

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, (q_idx - kv_idx + S) // divide]

        return t["q"], t["k"], t["v"], rel_bias

    return leaves, build


def halved_rows_case():
    """Per-query and per-key tables read at ``idx // 2``: two rows (or columns) of a tile add into
    one element, which plain row atomics would let meet in one instruction."""
    B, H, L, S = 2, 2, 64, 96
    leaves = {**qkv_leaves(B, H, H, L, S, 32), "temp": randn(B, H, L // 2), "key_bias": randn(H, S // 2)}

    def build(t):
        temp, key_bias = t["temp"], t["key_bias"]

        def tables(score, b, h, q_idx, kv_idx):
            return score * temp[b, h, q_idx // 2] + key_bias[h, kv_idx // 2]

        return t["q"], t["k"], t["v"], tables

    return leaves, build


@pytest.mark.parametrize("case", ["slopes", "rel_bias", "rel_bias_halved", "halved_rows"])
def test_deterministic_gradients_match_float64(case, slot_calls):
    if case == "slopes":
        leaves, build = learnable_alibi()
        check_grads(leaves, build, causal_mask, options=DETERMINISTIC)
    elif case == "rel_bias":
        check_grads(*rel_bias_case(), causal_mask, options=DETERMINISTIC)
    elif case == "rel_bias_halved":
        check_grads(*rel_bias_case(divide=3), causal_mask, options=DETERMINISTIC)
    else:
        check_grads(*halved_rows_case(), options=DETERMINISTIC)
    assert slot_calls, "the deterministic dK/dV launch did not run"


def test_gqa_and_broadcast_batch_keep_one_slot_per_program(slot_calls):
    H, Hkv, L = 4, 2, 96
    leaves = {"q": randn(2, H, L, 32), "k": randn(1, Hkv, L, 32), "v": randn(1, Hkv, L, 32), "slopes": randn(H)}

    def build(t):
        slopes = t["slopes"]

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return t["q"], t["k"], t["v"], alibi

    check_grads(leaves, build, causal_mask, gqa=True, options=DETERMINISTIC)
    # Key tiles x key/value heads x query batches (the broadcast batch's slices are separate programs).
    (programs, numel), = slot_calls
    assert programs % (Hkv * 2) == 0 and numel == H


def test_torch_deterministic_switch_turns_it_on(slot_calls):
    leaves, build = learnable_alibi()
    torch.use_deterministic_algorithms(True)
    try:
        check_grads(leaves, build, causal_mask)
    finally:
        torch.use_deterministic_algorithms(False)
    assert slot_calls, "torch.use_deterministic_algorithms(True) did not reach the Triton backward"


def test_the_option_wins_over_torch_switch(slot_calls):
    leaves, build = learnable_alibi()
    torch.use_deterministic_algorithms(True)
    try:
        check_grads(leaves, build, causal_mask, options={"BACKEND": "TRITON", "DETERMINISTIC": False})
    finally:
        torch.use_deterministic_algorithms(False)
    assert not slot_calls


def test_deterministic_and_default_agree_and_repeat_bit_for_bit():
    leaves, build = rel_bias_case()
    first, upstream = check_grads(leaves, build, causal_mask, options=DETERMINISTIC)
    first = {name: g.clone() for name, g in first.items()}
    for t in leaves.values():
        t.grad = None
    again, _ = check_grads(leaves, build, causal_mask, options=DETERMINISTIC, upstream=upstream)
    for name in first:
        assert torch.equal(first[name], again[name]), f"d{name} differs between two deterministic runs"
    for t in leaves.values():
        t.grad = None
    default, _ = check_grads(leaves, build, causal_mask, upstream=upstream)
    for name in first:
        torch.testing.assert_close(default[name], first[name], rtol=1e-5, atol=1e-5)


def test_rendered_dkdv_kernel_waits_for_its_slot_only_with_learnable_tensors():
    from flexattn.lowering import index_bounds
    from flexattn.trace import trace_mod

    slopes = torch.randn(4, requires_grad=True)
    frozen = slopes.detach()

    def learnable(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def fixed(score, b, h, q_idx, kv_idx):
        return score + frozen[h] * (kv_idx - q_idx)

    sources = {}
    for name, mod in (("learnable", learnable), ("fixed", fixed)):
        kernel = backward.backward_kernel(trace_mod(mod, "score_mod")[0], None)
        sources[name] = kernel.compiled(index_bounds(1, 4, 64, 64)).source
    assert "GRAD_TURNS + slot" in sources["learnable"] and "slot.to(tl.int64) * GRAD_SLOT_STRIDE" in sources["learnable"]
    assert "GRAD_TURNS + slot" not in sources["fixed"]


@pytest.mark.parametrize("options, launches", [({"DETERMINISTIC": True}, 3), ({}, 1)])
def test_a_deterministic_call_runs_until_its_plan_has_settled(options, launches):
    # The replan rule ([Note] Tiles the compiler made costly) gives a problem's later calls other
    # tiles than its first; their sums run in another order. A deterministic call keeps launching
    # (fresh outputs each time) until the plan stays, so its first result is every later one's.
    from flexattn.kernels.family import KernelFamily, Plan, Problem

    family = KernelFamily(None, None, tanh_approx=False)
    steps_seen = []
    replans = iter([2, 3])  # two cheaper plans, then the last one stays

    def after_compile(plan, kernels):
        nxt = next(replans, None)
        return plan._replace(check_compiled=False) if nxt is None else plan._replace(steps={"tiles": nxt})

    family._plan_after_compile = after_compile

    def launch(plan, problem):
        steps_seen.append(plan.steps["tiles"])
        return f"result of tiles {plan.steps['tiles']}", {}

    first = Plan(None, {"tiles": 1}, (64, 64), 2, check_compiled=True)
    family._new_plan = lambda problem: first
    family._launch = launch
    problem = Problem(None, None, None, None, None, 1.0, [], [], options)  # only the options are read
    result = family._run("key", problem)
    assert len(steps_seen) == launches
    assert result == f"result of tiles {steps_seen[-1]}"
