"""Python numbers a mod reads are inputs of its graph and its kernels (flexattn/trace/numbers.py).

A new window size, prefix length, soft-cap or tensor size reuses the traced graph and the compiled
kernel, and the result follows the number's value now, never an earlier one; a number the mod uses
in Python (a branch, an index, ``int()``) is specialized: a new value traces again.
"""

from __future__ import annotations

import functools

import pytest
import torch
from numerics import rel_err

import flexattn
from flexattn import create_block_mask, flex_attention
from flexattn.codegen import source as codegen_source
from flexattn.reference import reference_attention
from flexattn.trace import counts, trace_mod

B, H, L, E = 1, 2, 96, 16
BACKENDS = ["PYTORCH", "TRITON"]


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, E, generator=g) for _ in range(3)]


def attend(score_mod=None, mask_mod=None, backend="TRITON", seed=0):
    q, k, v = inputs(seed)
    bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=32) if mask_mod else None
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, kernel_options={"BACKEND": backend})
    want, _, _ = reference_attention(*(t.double() for t in (q, k, v)), score_mod=score_mod, mask_mod=mask_mod)
    return rel_err(out, want)


def graph_inputs(fn, kind="score_mod"):
    traced, values = trace_mod(fn, kind)
    return traced, values[len(traced.captured):]


# -- every place a mod reads a number from ---------------------------------------------------------

WINDOW = 8


class Config:
    def __init__(self, window):
        self.window = window


class Slotted:
    __slots__ = ("window",)

    def __init__(self, window):
        self.window = window


class Module(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window

    def mod(self, score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= self.window, score, -score)


def window_closure(w):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= w, score, -score)
    return mod


def window_global(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx - kv_idx <= WINDOW, score, -score)


def window_default(score, b, h, q_idx, kv_idx, w=8):
    return torch.where(q_idx - kv_idx <= w, score, -score)


def window_kwdefault(score, b, h, q_idx, kv_idx, *, w=8):
    return torch.where(q_idx - kv_idx <= w, score, -score)


def window_tuple(cfg):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= cfg[1], score, -score * cfg[0])
    return mod


def window_list(cfg):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= cfg[0], score, -score)
    return mod


def window_dict(cfg):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= cfg["w"], score, -score)
    return mod


def window_object(obj):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= obj.window, score, -score)
    return mod


def window_size(t):
    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= t.shape[0], score, -score)
    return mod


def _set_global(value):
    global WINDOW
    WINDOW = value


# (name, make the mod reading window value w: a fresh object, or the same one changed in place)
SOURCES = {
    "closure": lambda w, mod: window_closure(w),
    "global": lambda w, mod: (_set_global(w), window_global)[1],
    "default": lambda w, mod: (setattr(window_default, "__defaults__", (w,)), window_default)[1],
    "kwdefault": lambda w, mod: (setattr(window_kwdefault, "__kwdefaults__", {"w": w}), window_kwdefault)[1],
    "partial": lambda w, mod: functools.partial(window_default, w=w),
    "tuple": lambda w, mod: window_tuple((2.0, w)),
    "list (in place)": lambda w, mod: (mod.__closure__[0].cell_contents.__setitem__(0, w), mod)[1] if mod
    else window_list([w]),
    "dict (in place)": lambda w, mod: (mod.__closure__[0].cell_contents.__setitem__("w", w), mod)[1] if mod
    else window_dict({"w": w}),
    "object attribute (in place)": lambda w, mod: (setattr(mod.__closure__[0].cell_contents, "window", w), mod)[1]
    if mod else window_object(Config(w)),
    "slots (in place)": lambda w, mod: (setattr(mod.__closure__[0].cell_contents, "window", w), mod)[1]
    if mod else window_object(Slotted(w)),
    "bound method of an nn.Module (in place)": lambda w, mod: (setattr(mod.__self__, "window", w), mod)[1]
    if mod else Module(w).mod,
    "tensor size": lambda w, mod: window_size(torch.zeros(w)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_number_read_from_anywhere_is_an_input_and_one_trace_serves_every_value(source, backend, one_thread):
    make = SOURCES[source]
    mod = None
    traced_first = None
    traces = kernels = None
    for w in (3, 17, 40, 3, 64):
        mod = make(w, mod)
        traced, numbers = graph_inputs(mod)
        assert w in numbers, f"{source}: the window is not an input of the graph ({numbers})"
        if traced_first is None:
            traced_first = traced
            assert attend(mod, backend=backend) < 1e-5
            traces, kernels = counts.traces, len(codegen_source._loaded)
            continue
        assert traced is traced_first or source == "tensor size", f"{source}: a new value made another graph"
        assert attend(mod, backend=backend) < 1e-5, f"{source}: wrong result at window {w}"
    if source != "tensor size":  # a new shape is a new walk key: traced again, the same graph's kernel
        assert counts.traces == traces, f"{source}: a new value traced again"
    assert len(codegen_source._loaded) == kernels, f"{source}: a new value compiled another kernel"


def test_a_class_attribute_is_a_constant_of_the_graph():
    # Tracing cannot put a stand-in in a class's dict (a mappingproxy): such a number is keyed by value.
    class Fixed:
        window = 5

    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx <= Fixed.window, score, -score)

    first, numbers = graph_inputs(mod)
    assert numbers == []
    Fixed.window = 9
    second, _ = graph_inputs(mod)
    assert second is not first and attend(mod) < 1e-5


# -- what specializes ------------------------------------------------------------------------------


def test_a_number_used_in_python_specializes_and_a_new_value_traces_again():
    def make(n, causal):
        def mod(score, b, h, q_idx, kv_idx):
            if causal:  # Python decides: the graph holds for this value of causal only
                return torch.where(q_idx >= kv_idx, score * n, -score)
            return score * n
        return mod

    causal_graph, numbers = graph_inputs(make(2.0, True))
    assert numbers == [2.0] and any(value is True for _, _, value in causal_graph.specialized)
    assert graph_inputs(make(3.5, True))[0] is causal_graph  # n is an input: the same graph
    plain = graph_inputs(make(3.5, False))[0]
    assert plain is not causal_graph
    assert attend(make(3.5, True)) < 1e-5 and attend(make(3.5, False)) < 1e-5


@pytest.mark.parametrize("use", ["range", "int", "index", "sqrt", "pow", "str", "dict key"])
def test_python_uses_of_a_number_specialize_it(use):
    import math

    def make(n):
        table = torch.arange(40, dtype=torch.float32)
        forms = {
            "range": lambda score, q: score + len(range(n)),
            "int": lambda score, q: score * int(n),
            "index": lambda score, q: score + table[n],
            "sqrt": lambda score, q: score / math.sqrt(n),
            "pow": lambda score, q: score * 2 ** n / 2 ** 20,
            "str": lambda score, q: score * float(str(n)),
            "dict key": lambda score, q: score * {n: 2.0}.get(n, 1.0),
        }
        body = forms[use]

        def mod(score, b, h, q_idx, kv_idx):
            return body(score, q_idx)
        return mod

    first = graph_inputs(make(4))[0]
    assert first.specialized, "the value the graph holds is not recorded"
    second = graph_inputs(make(9))[0]
    assert second is not first
    assert attend(make(4), backend="PYTORCH") < 1e-5 and attend(make(9), backend="PYTORCH") < 1e-5


def test_a_value_shared_with_a_literal_of_the_same_call_specializes():
    # torch.clamp(x, 0, n) with n == 0: which 0 the op got cannot be told, so n is a constant here.
    def make(n):
        def mod(score, b, h, q_idx, kv_idx):
            return score + torch.clamp(q_idx - kv_idx, 0, n).to(torch.float32) * 0.01
        return mod

    zero, numbers = graph_inputs(make(0))
    assert numbers == [] and zero.specialized == ((0, int, 0),)
    four, numbers = graph_inputs(make(4))
    assert numbers == [4] and four is not zero
    assert graph_inputs(make(11))[0] is four
    for n in (0, 4, 11):
        assert attend(make(n)) < 1e-5


def test_arithmetic_on_numbers_is_evaluated_at_every_call():
    def make(w, cap):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.where((q_idx - kv_idx) // (w * 2 + 1) == 0, torch.tanh(score / (cap * 0.5)) * cap, -score)
        return mod

    first, numbers = graph_inputs(make(3, 10.0))
    assert sorted(numbers) == [5.0, 7, 10.0]
    again, numbers = graph_inputs(make(5, 4.0))
    assert again is first and sorted(numbers) == [2.0, 4.0, 11]
    for backend in BACKENDS:
        assert attend(make(5, 4.0), backend=backend) < 1e-5


def test_a_number_changing_type_traces_again():
    ints, _ = graph_inputs(window_closure(4))
    floats, numbers = graph_inputs(window_closure(4.5))
    bools, _ = graph_inputs(window_closure(True))
    assert len({ints, floats, bools}) == 3 and numbers == [4.5]
    assert [n.kind for n in floats.numbers] == [float]


def test_ints_beyond_the_kernels_range_are_constants():
    from flexattn.trace import NUMBER_INT_LIMIT

    small, numbers = graph_inputs(window_closure(4))
    assert numbers == [4]
    huge, numbers = graph_inputs(window_closure(NUMBER_INT_LIMIT + 1))
    assert numbers == [] and huge is not small  # the lowering assumes |n| <= NUMBER_INT_LIMIT
    assert attend(window_closure(NUMBER_INT_LIMIT + 1)) < 1e-5
    assert graph_inputs(window_closure(5))[0] is small


def test_mask_mods_read_numbers_at_every_call_too():
    def prefix_lm(n):
        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (q_idx >= kv_idx)
        return mask

    first, _ = graph_inputs(prefix_lm(10), "mask_mod")
    for n in (10, 33, 70):
        assert graph_inputs(prefix_lm(n), "mask_mod")[0] is first
        for backend in BACKENDS:
            assert attend(mask_mod=prefix_lm(n), backend=backend) < 1e-5


def test_gradients_reach_tensors_next_to_numbers():
    bias = torch.randn(H, requires_grad=True)

    def make(scale):
        def mod(score, b, h, q_idx, kv_idx):
            return score * scale + bias[h] * (kv_idx - q_idx)
        return mod

    for scale in (0.5, 2.0):
        q, k, v = (t.requires_grad_() for t in inputs())
        for backend in BACKENDS:
            out = flex_attention(q, k, v, score_mod=make(scale), kernel_options={"BACKEND": backend})
            grads = torch.autograd.grad(out.sum(), (q, bias))
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            biasd = bias.detach().double().requires_grad_()

            def mod64(score, b, h, q_idx, kv_idx, scale=scale):
                return score * scale + biasd[h] * (kv_idx - q_idx)

            want = reference_attention(qd, kd, vd, score_mod=mod64)[0]
            want_grads = torch.autograd.grad(want.sum(), (qd, biasd))
            for got, expected in zip(grads, want_grads):
                assert rel_err(got, expected) < 1e-5, (backend, scale)


# -- tracing leaves the user's objects as they were -----------------------------------------------


def test_tracing_puts_every_original_back_even_when_the_mod_fails():
    cfg = Config(7)
    values = [7, 8.5]

    def mod(score, b, h, q_idx, kv_idx, extra=values):
        if score.sum() > 0:  # reads a tensor's value: cannot be traced
            return score
        return score * cfg.window + extra[1]

    with pytest.raises(Exception):
        trace_mod(mod, "score_mod")
    assert cfg.window == 7 and type(cfg.window) is int and values == [7, 8.5] and mod.__defaults__[0] is values
