"""Tracing mods into aten graphs: lifted captures, the cache, and errors that name the fix."""

import functools

import pytest
import sys

import torch

from flexattn import and_masks, trace
from flexattn.errors import ModTraceError
from flexattn.trace import trace_mod

GLOBAL_BIAS = torch.randn(4, 32)


def idx(*values):
    return [torch.tensor(v, dtype=torch.int32) for v in values]


def run_graph(traced, captured, score, b, h, q, kv):
    args = ([torch.tensor(score)] if traced.kind == "score_mod" else []) + idx(b, h, q, kv)
    return traced.graph_module(*args, *captured)


def test_closure_global_and_helper_tensors_are_lifted_by_name():
    doc = torch.randint(0, 3, (32,))
    slopes = torch.rand(4, requires_grad=True)

    def helper(h):
        return slopes[h]

    def mod(score, b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return torch.where(same, score * helper(h) + GLOBAL_BIAS[h, kv_idx], score)

    traced, captured = trace_mod(mod, "score_mod")
    names = [c.name for c in traced.captured]
    assert sorted(names) == ["GLOBAL_BIAS", "doc", "slopes"]
    by_name = dict(zip(names, captured))
    assert by_name["doc"] is doc and by_name["slopes"] is slopes and by_name["GLOBAL_BIAS"] is GLOBAL_BIAS
    assert [c.requires_grad for c in traced.captured][names.index("slopes")]
    for q_idx, kv_idx in [(3, 5), (7, 7), (31, 0)]:
        expected = mod(torch.tensor(1.5), *idx(0, 2, q_idx, kv_idx))
        assert torch.equal(run_graph(traced, captured, 1.5, 0, 2, q_idx, kv_idx), expected)


def test_gradients_reach_captured_tensors_through_the_graph():
    bias = torch.randn(8, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    traced, captured = trace_mod(mod, "score_mod")
    out = torch.vmap(traced.graph_module, in_dims=(0, None, None, None, 0, None))(
        torch.randn(8), *idx(0, 0, 0), torch.arange(8, dtype=torch.int32), *captured
    )
    out.sum().backward()
    assert torch.equal(bias.grad, torch.ones(8))


def test_combined_masks_and_partials_are_walked():
    window = torch.tensor(4)

    def near(b, h, q_idx, kv_idx, limit):
        return (q_idx - kv_idx).abs() <= limit

    mask = and_masks(lambda b, h, q, kv: q >= kv, functools.partial(near, limit=window))
    traced, captured = trace_mod(mask, "mask_mod")
    assert captured == [window]
    assert bool(run_graph(traced, captured, None, 0, 0, 9, 6)) is True
    assert bool(run_graph(traced, captured, None, 0, 0, 9, 2)) is False


def test_same_callable_or_same_code_does_not_retrace():
    def make(table):
        def mod(score, b, h, q_idx, kv_idx):
            return score + table[q_idx]

        return mod

    first = make(torch.randn(16))
    trace_mod(first, "score_mod")
    count = trace.counts.traces
    trace_mod(first, "score_mod")
    second_table = torch.randn(16)
    traced, captured = trace_mod(make(second_table), "score_mod")
    assert trace.counts.traces == count
    assert captured[0] is second_table
    trace_mod(make(torch.randn(17)), "score_mod")  # a new shape may change the graph: retrace
    assert trace.counts.traces == count + 1


def test_plain_values_are_part_of_the_key_with_their_type():
    def make(offset):
        return lambda score, b, h, q_idx, kv_idx: score + (q_idx + offset)

    int_graph = trace_mod(make(1), "score_mod")[0]
    float_graph = trace_mod(make(1.0), "score_mod")[0]
    assert int_graph is not float_graph


def test_reassigned_closure_value_is_seen_by_the_warm_path():
    offset = 1

    def mod(score, b, h, q_idx, kv_idx):
        return score + offset

    traced, captured = trace_mod(mod, "score_mod")
    assert float(run_graph(traced, captured, 0.0, 0, 0, 0, 0)) == 1.0
    offset = 5  # noqa: F841 (read by mod through its closure cell)
    traced, captured = trace_mod(mod, "score_mod")
    assert float(run_graph(traced, captured, 0.0, 0, 0, 0, 0)) == 5.0


def test_tensor_built_inside_the_mod_is_a_fixed_input():
    def mod(score, b, h, q_idx, kv_idx):
        return score * torch.tensor(3.0)

    traced, captured = trace_mod(mod, "score_mod")
    assert len(captured) == 1 and traced.captured[0].walk_index is None
    assert float(run_graph(traced, captured, 2.0, 0, 0, 0, 0)) == 6.0


@pytest.mark.parametrize(
    "body",
    [
        lambda score, b, h, q_idx, kv_idx: score if q_idx > 3 else -score,
        lambda score, b, h, q_idx, kv_idx: score * q_idx.item(),
        lambda score, b, h, q_idx, kv_idx: score * int(kv_idx),
    ],
    ids=["if", "item", "int"],
)
def test_data_dependent_python_is_an_error_that_names_the_fix(body):
    with pytest.raises(ModTraceError, match="(?s)Cannot trace score_mod.*test_trace.py.*torch.where"):
        trace_mod(body, "score_mod")


def test_mask_mod_returning_python_bool_is_an_error():
    with pytest.raises(ModTraceError, match="must return a bool tensor"):
        trace_mod(lambda b, h, q_idx, kv_idx: True, "mask_mod")


def test_slicing_a_captured_tensor_is_an_error_with_the_supported_form():
    table = torch.randn(4, 8)
    with pytest.raises(ModTraceError, match=r"bias\[h, q_idx - kv_idx\]"):
        trace_mod(lambda score, b, h, q_idx, kv_idx: score + table[:, kv_idx][0], "score_mod")


def test_mod_that_cannot_run_on_the_example_values_still_traces():
    # At the example indices (q_idx = kv_idx = 1) this gather is out of range; the recorder then
    # traces on meta tensors, which carry no values.
    table = torch.randn(40)

    def far(score, b, h, q_idx, kv_idx):
        return score + table[q_idx + 100 - 2 * kv_idx - 90]

    traced, captured = trace_mod(far, "score_mod")
    assert float(run_graph(traced, captured, 0.0, 0, 0, 5, 3)) == pytest.approx(float(table[9]))


def test_first_trace_is_fast():
    import subprocess
    import sys

    code = (
        "import time, torch, flexattn\n"
        "from flexattn.trace import trace_mod\n"
        "t = time.perf_counter()\n"
        "trace_mod(lambda s, b, h, q, kv: torch.where(q >= kv, s * 2, s), 'score_mod')\n"
        "print(time.perf_counter() - t)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**__import__("os").environ, "PYTHONPATH": __import__("os").getcwd()})
    # Tracing must not pull in Dynamo/Inductor (over a second): a first trace is milliseconds.
    assert float(done.stdout.strip().splitlines()[-1]) < 0.5


def test_graph_on_another_device_places_factories_there():
    # Tracing runs on CPU tensors, so `b.new_ones(())` and `device=b.device` record device=cpu; the
    # PyTorch backend on a GPU runs the graph from graph_module_on(query.device) instead.
    from torch.nn.attention.flex_attention import noop_mask as torch_noop_mask

    traced, _ = trace_mod(torch_noop_mask, "mask_mod")
    placed = traced.graph_module_on(torch.device("meta"))
    devices = [n.kwargs["device"] for n in placed.graph.nodes if "device" in n.kwargs]
    assert devices and all(d == torch.device("meta") for d in devices)
    assert traced.graph_module_on(torch.device("meta")) is placed  # one copy per device
    assert traced.graph_module_on(torch.device("cpu")) is traced.graph_module
    assert all(n.kwargs.get("device") in (None, torch.device("cpu")) for n in traced.graph.nodes)


def test_gpu_tables_are_traced_on_cpu_stand_ins(monkeypatch):
    # Tracing runs the mod on example indices (q_idx = kv_idx = 1). On a GPU table of one row that
    # index fired a device-side assert (fuzz seed 7 on an H100), which no exception reports and which
    # ruined the process's CUDA context. The recorder runs on CPU stand-ins of GPU tensors.
    seen = []
    real_index = torch.ops.aten.index.Tensor

    def table_mod(b, h, q_idx, kv_idx):
        return q_idx > table[kv_idx]

    table = torch.tensor([5], dtype=torch.int32, device="meta")  # stands for a GPU tensor here

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is real_index:
                seen.append(args[0].device.type)
            return func(*args, **(kwargs or {}))

    with Spy():
        traced, captured = trace_mod(table_mod, "mask_mod")
    assert captured[0] is table
    assert seen and "meta" not in seen[:1]  # the first (real-value) attempt ran on the CPU


def test_constants_are_copied_by_another_thread_and_kept(monkeypatch):
    # A CUDA-graph tree's warm-up puts the warming thread's allocations into the graph's pool (so
    # they cannot be kept), a capture may not copy from host memory, and a copy made on one stream
    # must be done before another stream reads it: the constants are copied by a worker thread that
    # waits for the copy, and kept (flexattn/cuda_graphs.py).
    import threading

    import flexattn.cuda_graphs as cuda_graphs
    import flexattn.trace as trace

    threads = []

    class Constant:
        def to(self, device):
            threads.append(threading.current_thread().name)
            return ("copy", device)

    assert cuda_graphs.copied_outside_graph_pools((Constant(), None), torch.device("cpu")) == (
        ("copy", torch.device("cpu")), None)
    assert threads and threads[0].startswith("flexattn-copy")

    def bucket(score, b, h, q_idx, kv_idx):
        return score + torch.tensor([0.5, 1.5])[(q_idx - kv_idx) % 2]

    traced, _ = trace.trace_mod(bucket, "score_mod")
    assert any(c.fixed_value is not None for c in traced.captured)
    calls = []
    traced_module = sys.modules["flexattn.trace.traced"]
    real = traced_module.copied_outside_graph_pools
    monkeypatch.setattr(traced_module, "copied_outside_graph_pools", lambda t, d: calls.append(d) or real(t, d))
    first = traced.fixed_values_on(torch.device("cpu"))
    again = traced.fixed_values_on(torch.device("cpu"))
    assert len(calls) == 1 and first is again  # copied once, kept
    for value, c in zip(first, traced.captured):
        assert (value is None) == (c.fixed_value is None)
        assert value is None or torch.equal(value, c.fixed_value)
