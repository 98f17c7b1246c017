"""What a call keeps, per stream, around CUDA graphs (flexattn/cuda_graphs.py): the rule, on the
CPU with the CUDA queries stood in for. tests/test_gpu_streams.py checks it on a GPU."""

import sys
import types

import pytest
import torch

import flexattn.cuda_graphs as cuda_graphs


class _Stream:
    def __init__(self, handle):
        self.handle = handle

    def __eq__(self, other):
        return self.handle == other.handle


@pytest.fixture
def cuda_state(monkeypatch):
    state = types.SimpleNamespace(current=1, capturing=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(state.current))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: _Stream(1))
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    return state


GPU = torch.device("cuda", 0)


def test_allocations_are_kept_on_any_stream_of_the_program(cuda_state):
    assert cuda_graphs.may_keep_allocations(GPU)  # the default stream
    cuda_state.current = 7
    assert cuda_graphs.may_keep_allocations(GPU)  # a stream of its own, as a server runs: kept too
    assert cuda_graphs.may_keep_allocations(torch.device("cpu"))


def test_nothing_is_kept_inside_a_capture(cuda_state):
    cuda_state.capturing = True
    assert not cuda_graphs.may_keep_allocations(GPU)
    cuda_state.current = 7
    assert not cuda_graphs.may_keep_allocations(GPU)


def _graph_trees(monkeypatch, get_manager, reachable: bool = True):
    # ``reachable``: this thread reaches the tree managers' containers (torch keeps them in a
    # thread-local, stashed into the threads a tree runs in)
    trees = types.ModuleType("torch._inductor.cudagraph_trees")
    trees.get_manager = get_manager
    trees.local = types.SimpleNamespace(**({"tree_manager_containers": {}} if reachable else {}))
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)


def test_nothing_is_kept_on_a_graph_trees_stream(cuda_state, monkeypatch):
    # torch.compile(mode="reduce-overhead") warms up on its tree's stream, allocating into the
    # graph's private pool: nothing made there may be kept.
    manager = types.SimpleNamespace(stream=_Stream(7))
    asked = []
    _graph_trees(monkeypatch, lambda index, create_if_none_exists=True: asked.append(create_if_none_exists) or manager)
    cuda_state.current = 7
    assert not cuda_graphs.may_keep_allocations(GPU)
    assert asked == [False]  # never makes a tree manager itself
    cuda_state.current = 8
    assert cuda_graphs.may_keep_allocations(GPU)  # another side stream
    cuda_state.current = 1
    assert cuda_graphs.may_keep_allocations(GPU)
    _graph_trees(monkeypatch, lambda index, create_if_none_exists=True: None)  # no tree on this thread
    cuda_state.current = 7
    assert cuda_graphs.may_keep_allocations(GPU)


def test_unknown_graph_tree_internals_keep_nothing_on_side_streams(cuda_state, monkeypatch):
    def moved(index, create_if_none_exists=True):
        raise AttributeError("internals moved")

    _graph_trees(monkeypatch, moved)
    cuda_state.current = 7
    assert not cuda_graphs.may_keep_allocations(GPU)  # slower, never wrong
    cuda_state.current = 1
    assert cuda_graphs.may_keep_allocations(GPU)  # the default stream needs no tree


def test_a_thread_that_reaches_no_graph_tree_keeps_on_its_side_stream(cuda_state, monkeypatch):
    # autograd's backward thread after a compiled forward on a side stream: torch 2.11's get_manager
    # fails an assertion there (no containers in that thread), and the compiled backward kept
    # nothing, allocating on every call (tests/test_gpu_streams.py, H100, 2026-12-07).
    def unreachable(index, create_if_none_exists=True):
        raise AssertionError

    _graph_trees(monkeypatch, unreachable, reachable=False)
    monkeypatch.setattr(torch._C, "_is_key_in_tls", lambda key: False)
    cuda_state.current = 7
    assert cuda_graphs.may_keep_allocations(GPU)
    # Stashed into this thread by a tree that runs here: asked as any other thread would be.
    monkeypatch.setattr(torch._C, "_is_key_in_tls", lambda key: key == "tree_manager_containers")
    assert not cuda_graphs.may_keep_allocations(GPU)


def test_in_a_fresh_thread_the_real_graph_trees_module_is_read_without_an_error():
    import threading

    import torch._inductor.cudagraph_trees  # noqa: F401 - what torch.compile loads

    seen = []
    thread = threading.Thread(target=lambda: seen.append(cuda_graphs._graph_tree_stream(_Stream(7), GPU)))
    thread.start()
    thread.join()
    assert seen == [False]  # no tree exists in this process


def test_the_stream_key_is_the_raw_handle_of_the_current_stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    assert cuda_graphs.stream_key(torch.device("cuda", 3)) == 1003
    assert cuda_graphs.stream_key(torch.device("cpu")) is None


class _Event:
    def __init__(self, complete=False):
        self.complete, self.waited_by = complete, []

    def query(self):
        return self.complete


def test_a_mark_makes_other_streams_wait_once_and_is_done_once_its_work_ran(cuda_state, monkeypatch):
    waits = []

    class Current:
        def wait_event(self, event):
            waits.append((cuda_state.current, event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Current())
    monkeypatch.setattr(cuda_graphs, "stream_key", lambda device: cuda_state.current)
    event = _Event()
    mark = cuda_graphs.StreamMark(1, event)
    mark.order_after(GPU)  # the maker's stream: stream order suffices
    assert waits == [] and not mark.done
    cuda_state.current = 7
    mark.order_after(GPU)
    mark.order_after(GPU)
    assert waits == [(7, event)]  # once per stream
    cuda_state.capturing = True
    cuda_state.current = 8
    mark.order_after(GPU)  # a capture may not wait for an outside event
    assert waits == [(7, event)]
    cuda_state.capturing = False
    event.complete = True
    cuda_state.current = 1
    mark.order_after(GPU)
    assert mark.done


def test_derived_data_on_the_cpu_carries_no_mark():
    from flexattn import create_block_mask
    from flexattn.masks.block_mask import DerivedKey

    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
    key = DerivedKey("a test's data")
    assert mask.derived(key, lambda m: 42) == 42
    assert mask.__dict__["_derived"][key][-1] is None
    assert cuda_graphs.mark_stream(torch.device("cpu")) is None
