"""The trace cache never hands one mod another mod's graph or tensors (issue 8, items 1 and 4).

A mod's graph and captured inputs are cached by a key of everything the mod can read, and warm
calls with the same callable object skip the search of its reads by re-reading what it read. These
tests change each thing a mod can read (library closures, closure cells, globals, defaults, object attributes,
namespaces, modules) between calls, recycle ids, and check that the traced graph, evaluated on
the captured inputs ``trace_mod`` returns, agrees with the mod itself; a few go end to end through
the PyTorch backend against the float64 reference, gradients included.
"""

import functools
import gc
import types
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from numerics import rel_err

import flexattn
from flexattn import trace
from flexattn.reference import reference_attention
from flexattn.trace import trace_mod

PYTORCH = {"BACKEND": "PYTORCH"}
POINTS = [(0, 0), (5, 3), (3, 5), (10, 40), (40, 10), (70, 2), (127, 100), (31, 31)]


def idx(*values):
    return [torch.tensor(v, dtype=torch.int32) for v in values]


def run_graph(traced, captured, q_idx, kv_idx, score=0.75, h=1):
    args = ([torch.tensor(score)] if traced.kind == "score_mod" else []) + idx(0, h, q_idx, kv_idx)
    return traced.graph_module(*args, *captured)


def run_mod(mod, kind, q_idx, kv_idx, score=0.75, h=1):
    args = ([torch.tensor(score)] if kind == "score_mod" else []) + idx(0, h, q_idx, kv_idx)
    return mod(*args)


def assert_graph_matches_mod(mod, kind, points=POINTS):
    """trace_mod's graph on its captured inputs equals the mod run eagerly, at every point."""
    traced, captured = trace_mod(mod, kind)
    for q_idx, kv_idx in points:
        got, want = run_graph(traced, captured, q_idx, kv_idx), run_mod(mod, kind, q_idx, kv_idx)
        assert torch.equal(got, want), f"{kind} at q_idx={q_idx}, kv_idx={kv_idx}: graph {got}, mod {want}"
    return traced, captured


def holds(captured, tensor):
    return any(c is tensor for c in captured)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def noncausal(b, h, q_idx, kv_idx):
    return q_idx <= kv_idx


def prefix(n):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < n

    return prefix_mask


def attention_in_float64(score_mod=None, mask_mod=None, L=128, H=2, block=32, grad=(), score_mod_for_grad=None):
    """flex_attention on the PyTorch backend against the float64 reference; returns rel errors.

    ``grad``: tensors the score_mod reads that require grad; their gradients are compared too.
    """
    q, k, v = (torch.randn(1, H, L, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    block_mask = None
    if mask_mod is not None:
        block_mask = flexattn.create_block_mask(mask_mod, 1, H, L, L, device="cpu", BLOCK_SIZE=block)
    out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=PYTORCH)
    want, _, _ = reference_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    errors = [rel_err(out, want)]
    if grad:
        dout = torch.randn_like(out)
        got_grads = torch.autograd.grad(out, grad, dout)
        want_grads = torch.autograd.grad(want, grad, dout)
        for got, expected in zip(got_grads, want_grads):
            assert got is not None
            errors.append(rel_err(got, expected))
    return max(errors)


# ------------------------------------------------------------------------ item 1: library closures


@pytest.mark.parametrize("combinators", [torch_flex, flexattn], ids=["torch", "flexattn"])
def test_compositions_by_library_combinators_read_their_own_mods(combinators):
    # torch's or_masks returns a closure defined in torch: it used to be keyed by its name alone.
    # The two compositions differ only in a number their mods read: one graph, each its own number.
    short = combinators.or_masks(prefix(16), causal)
    long = combinators.or_masks(prefix(64), causal)
    first, first_values = assert_graph_matches_mod(short, "mask_mod")
    second, second_values = assert_graph_matches_mod(long, "mask_mod")
    assert first is second and first_values == [16] and second_values == [64]
    both = combinators.and_masks(long, prefix(8))
    assert assert_graph_matches_mod(both, "mask_mod")[0] is not first  # other code: its own graph
    assert assert_graph_matches_mod(combinators.or_masks(prefix(16), noncausal), "mask_mod")[0] is not first


@pytest.mark.parametrize("combinators", [torch_flex, flexattn], ids=["torch", "flexattn"])
def test_library_closure_captures_the_tensors_of_this_composition(combinators):
    def same_doc(doc):
        def doc_mask(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        return doc_mask

    doc_a = torch.randint(0, 3, (128,))
    doc_b = torch.randint(0, 5, (128,))
    _, captured_a = assert_graph_matches_mod(combinators.and_masks(same_doc(doc_a), causal), "mask_mod")
    _, captured_b = assert_graph_matches_mod(combinators.and_masks(same_doc(doc_b), causal), "mask_mod")
    assert holds(captured_a, doc_a) and holds(captured_b, doc_b) and not holds(captured_b, doc_a)


def test_torch_or_masks_compositions_end_to_end(one_thread):
    # Prefixes that end inside a block of 32, so the kernel applies the mask_mod there.
    assert attention_in_float64(mask_mod=torch_flex.or_masks(prefix(20), causal)) < 1e-12
    assert attention_in_float64(mask_mod=torch_flex.or_masks(prefix(70), causal)) < 1e-12


def test_paged_attention_mask_mod_reads_its_page_table():
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    paged = PagedAttention(n_pages=8, page_size=16, max_batch_size=1, device="cpu")
    paged.physical_to_logical[0] = torch.randperm(8)
    mask = paged.get_mask_mod(causal)
    _, captured = assert_graph_matches_mod(mask, "mask_mod")
    assert holds(captured, paged.physical_to_logical)
    paged.physical_to_logical[0] = torch.randperm(8)  # updated in place, as assign() does
    _, captured = assert_graph_matches_mod(mask, "mask_mod")
    other = PagedAttention(n_pages=8, page_size=32, max_batch_size=1, device="cpu")
    other.physical_to_logical[0] = torch.randperm(8)
    _, captured = assert_graph_matches_mod(other.get_mask_mod(causal), "mask_mod")
    assert holds(captured, other.physical_to_logical)


def test_attention_gym_sliding_windows_end_to_end(one_thread):
    masks = pytest.importorskip("attn_gym.masks")
    for window in (32, 64):
        mask = masks.generate_sliding_window(window)
        assert_graph_matches_mod(mask, "mask_mod")
        assert attention_in_float64(mask_mod=mask) < 1e-12


def test_attention_gym_prefix_lm_after_global_sliding_window_end_to_end(one_thread):
    masks = pytest.importorskip("attn_gym.masks")
    is_global = torch.zeros(128, dtype=torch.bool)
    is_global[[0, 50]] = True
    global_window = masks.generate_global_sliding_window(8, is_global)
    _, captured = assert_graph_matches_mod(global_window, "mask_mod")
    assert holds(captured, is_global)
    assert attention_in_float64(mask_mod=global_window) < 1e-12
    prefix_lm = masks.generate_prefix_lm_mask(40)
    assert trace_mod(prefix_lm, "mask_mod")[1] == [40]  # the prefix length: a number the graph takes
    assert_graph_matches_mod(prefix_lm, "mask_mod")
    assert attention_in_float64(mask_mod=prefix_lm) < 1e-12


# ------------------------------------------------------------- item 2: tensors reached by objects


class Holder:
    """A plain object whose method is the score_mod."""

    def __init__(self, table):
        self.table = table

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[kv_idx] * (h + 1)


class BiasModule(torch.nn.Module):
    """``table`` is a plain tensor attribute: neither a parameter nor a buffer."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[kv_idx] * (h + 1)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score - self.table[kv_idx]


NAMESPACE = types.SimpleNamespace(table=torch.randn(128))
CONFIG = Holder(torch.randn(128))
TABLES = types.ModuleType("user_tables")  # a user module imported as a global
TABLES.table = torch.randn(128)


def namespace_mod(score, b, h, q_idx, kv_idx):
    return score + NAMESPACE.table[kv_idx] * (h + 1)


def object_mod(score, b, h, q_idx, kv_idx):
    return score + CONFIG.table[kv_idx] * (h - 2)


def module_object_mod(score, b, h, q_idx, kv_idx):
    return score * TABLES.table[kv_idx]


def default_mod(score, b, h, q_idx, kv_idx, table=torch.randn(128)):
    return score + table[kv_idx] * h


@dataclass
class Route:
    """One way a score_mod reaches a tensor through an object."""

    make: Callable  # table -> the score_mod reading it (a new instance where the route has them)
    replace: Callable  # (score_mod, table) -> None: point the route at another tensor


def _set_global(name):
    def replace(mod, table):
        setattr(globals()[name], "table", table)

    return replace


def _make_global(name, factory):
    def make(table):
        globals()[name] = factory(table)
        return {"NAMESPACE": namespace_mod, "CONFIG": object_mod, "TABLES": module_object_mod}[name]

    return make


def _new_module(table):
    module = types.ModuleType("user_tables")
    module.table = table
    return module


def _make_default(table):
    # A second function object with the same code and another default, like a second instance.
    mod = types.FunctionType(default_mod.__code__, default_mod.__globals__, "default_mod", (table,))
    return mod


def _replace_default(mod, table):
    mod.__defaults__ = (table,)


ROUTES = {
    "bound_method": Route(lambda t: Holder(t).score_mod, lambda mod, t: setattr(mod.__self__, "table", t)),
    "module_attribute_method": Route(
        lambda t: BiasModule(t).score_mod, lambda mod, t: setattr(mod.__self__, "table", t)
    ),
    "module_as_mod": Route(lambda t: BiasModule(t), lambda mod, t: setattr(mod, "table", t)),
    "global_namespace": Route(_make_global("NAMESPACE", lambda t: types.SimpleNamespace(table=t)),
                              _set_global("NAMESPACE")),
    "global_object": Route(_make_global("CONFIG", Holder), _set_global("CONFIG")),
    "global_user_module": Route(_make_global("TABLES", _new_module), _set_global("TABLES")),
    "default_argument": Route(_make_default, _replace_default),
}


@pytest.fixture(params=sorted(ROUTES))
def route(request):
    return ROUTES[request.param]


def test_route_sees_in_place_updates(route):
    table = torch.randn(128)
    mod = route.make(table)
    _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, table)
    table.mul_(-3).add_(1)
    _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, table)


def test_route_sees_replaced_tensors(route):
    mod = route.make(torch.randn(128))
    assert_graph_matches_mod(mod, "score_mod")
    count = trace.counts.traces
    new = torch.randn(128)
    route.replace(mod, new)
    _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, new)
    assert trace.counts.traces == count  # same shape: the graph is reused, the tensor read fresh


def test_route_second_instance_gets_its_own_tensor(route):
    first, second = torch.randn(128), torch.randn(128)
    _, captured = assert_graph_matches_mod(route.make(first), "score_mod")
    assert holds(captured, first)
    _, captured = assert_graph_matches_mod(route.make(second), "score_mod")
    assert holds(captured, second) and not holds(captured, first)


def test_route_passes_gradients_to_the_tensor(route, one_thread):
    table = torch.randn(128, dtype=torch.float64, requires_grad=True)
    mod = route.make(table)
    traced, captured = trace_mod(mod, "score_mod")
    assert holds(captured, table) and any(c.requires_grad for c in traced.captured)
    assert attention_in_float64(score_mod=mod, grad=(table,)) < 1e-10


def test_module_parameters_and_buffers_are_read_fresh():
    module = BiasModule(torch.randn(128))
    module.table = torch.nn.Parameter(torch.randn(128))  # moves it into _parameters
    _, captured = assert_graph_matches_mod(module, "score_mod")
    assert holds(captured, module.table)
    del module.table
    module.register_buffer("table", torch.randn(128))
    _, captured = assert_graph_matches_mod(module, "score_mod")
    assert holds(captured, module.table)


class Slotted:
    __slots__ = ("table",)

    def __init__(self, table):
        self.table = table

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.table[kv_idx]


class WithProperty:
    def __init__(self, table):
        self._table = table

    @property
    def table(self):
        return self._table

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[kv_idx]


class Outer(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.inner = BiasModule(table)

    def forward(self, score, b, h, q_idx, kv_idx):
        return self.inner(score, b, h, q_idx, kv_idx) * 2


class Blocks(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.blocks = torch.nn.ModuleList([BiasModule(torch.randn(128)), BiasModule(table)])

    def forward(self, score, b, h, q_idx, kv_idx):
        return self.blocks[1](score, b, h, q_idx, kv_idx)


@pytest.mark.parametrize(
    "make, replace",
    [
        (Slotted, lambda mod, t: setattr(mod, "table", t)),
        (lambda t: WithProperty(t).score_mod, lambda mod, t: setattr(mod.__self__, "_table", t)),
        (Outer, lambda mod, t: setattr(mod.inner, "table", t)),
        (Blocks, lambda mod, t: setattr(mod.blocks[1], "table", t)),
    ],
    ids=["slots", "property", "submodule", "module_list"],
)
def test_more_object_routes(make, replace):
    table = torch.randn(128)
    mod = make(table)
    _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, table)
    table.add_(1)
    assert_graph_matches_mod(mod, "score_mod")
    new = torch.randn(128)
    replace(mod, new)
    _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, new)


# --------------------------------------------------------------------------- the warm-call path


class Location:
    """A place a mod reads ``value`` from; ``set`` changes what it holds."""

    def __init__(self, kind, initial):
        self.kind = kind
        if kind == "cell":
            value = initial

            def mod(score, b, h, q_idx, kv_idx):
                return score * torch.as_tensor(value).sum()

            def set_(new):
                nonlocal value
                value = new

            self.mod, self.set = mod, set_
        elif kind == "global":
            globals()["WARM_VALUE"] = initial
            self.mod, self.set = warm_global_mod, lambda new: globals().__setitem__("WARM_VALUE", new)
        elif kind == "default":
            self.mod = types.FunctionType(warm_default_mod.__code__, globals(), "warm", (initial,))
            self.set = lambda new: setattr(self.mod, "__defaults__", (new,))
        elif kind == "kwdefault":
            self.mod = types.FunctionType(warm_kwdefault_mod.__code__, globals(), "warm")
            self.mod.__kwdefaults__ = {"value": initial}
            self.set = lambda new: self.mod.__kwdefaults__.__setitem__("value", new)
        elif kind == "attribute":
            holder = WarmHolder(initial)
            self.mod, self.set = holder.score_mod, lambda new: setattr(holder, "value", new)
        elif kind == "list_item":
            cells = [initial]
            self.mod = functools.partial(warm_list_mod, cells)
            self.set = lambda new: cells.__setitem__(0, new)
        elif kind == "partial_keyword":
            self.mod = functools.partial(warm_keyword_mod, value=initial)
            self.set = lambda new: self.mod.keywords.__setitem__("value", new)


def warm_global_mod(score, b, h, q_idx, kv_idx):
    return score * torch.as_tensor(WARM_VALUE).sum()


def warm_default_mod(score, b, h, q_idx, kv_idx, value=None):
    return score * torch.as_tensor(value).sum()


def warm_kwdefault_mod(score, b, h, q_idx, kv_idx, *, value=None):
    return score * torch.as_tensor(value).sum()


def warm_list_mod(cells, score, b, h, q_idx, kv_idx):
    return score * torch.as_tensor(cells[0]).sum()


def warm_keyword_mod(score, b, h, q_idx, kv_idx, value=None):
    return score * torch.as_tensor(value).sum()


class WarmHolder:
    def __init__(self, value):
        self.value = value

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score * torch.as_tensor(self.value).sum()


LOCATIONS = ["cell", "global", "default", "kwdefault", "attribute", "list_item", "partial_keyword"]


def _value_of(mod):
    """The traced score_mod at score 1 (every location's mod returns ``score * value``)."""
    traced, captured = trace_mod(mod, "score_mod")
    return traced.graph_module(torch.tensor(1.0), *idx(0, 0, 0, 0), *captured)


CHANGES = ["tensor_of_another_shape", "plain_number", "resized_in_place", "requires_grad_in_place"]


@pytest.mark.parametrize("where", LOCATIONS)
def test_warm_path_re_reads_what_the_search_read(where):
    for change in CHANGES:
        first = torch.tensor(2.0)
        location = Location(where, first)
        mod = location.mod
        assert _value_of(mod).item() == 2.0
        traces, searches = trace.counts.traces, trace.counts.searches
        assert _value_of(mod).item() == 2.0
        # A warm call neither traces nor searches (lists and dicts used to force a search per call).
        assert (trace.counts.traces, trace.counts.searches) == (traces, searches)
        if change == "tensor_of_another_shape":
            location.set(torch.tensor([3.0]))
            expected, shape = 3.0, (1,)
        elif change == "plain_number":
            location.set(5)
            expected, shape = 5.0, None  # a Python number is a constant of the graph
        elif change == "resized_in_place":
            with torch.no_grad():
                first.set_(torch.tensor([7.0]))
            expected, shape = 7.0, (1,)
        else:
            first.requires_grad_()
            expected, shape = 2.0, ()
        assert _value_of(mod).item() == expected, change
        traced, captured = trace_mod(mod, "score_mod")
        if shape is None:
            assert traced.captured == () or traced.captured[0].walk_index is None, change
        else:
            assert traced.captured[0].shape == shape, change
        if change == "requires_grad_in_place":
            assert traced.captured[0].requires_grad and holds(captured, first)


def test_warm_path_sees_a_gather_table_of_another_shape():
    table = torch.randn(16)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    traced, _ = trace_mod(mod, "score_mod")
    assert traced.captured[0].shape == (16,)
    with torch.no_grad():
        table.set_(torch.randn(64))  # the same tensor object, now longer
    traced, captured = assert_graph_matches_mod(mod, "score_mod", [(0, 40), (1, 63)])
    assert traced.captured[0].shape == (64,)
    table = torch.randn(8)  # noqa: F841 (read by mod through its closure cell)
    traced, _ = assert_graph_matches_mod(mod, "score_mod", [(0, 7)])
    assert traced.captured[0].shape == (8,)


def test_shadowing_a_class_attribute_is_seen():
    class Scaled:
        factor = 2.0

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score * self.factor

    obj = Scaled()
    mod = obj.score_mod
    assert torch.equal(_value_of(mod), torch.tensor(2.0))
    obj.factor = 3.0
    assert torch.equal(_value_of(mod), torch.tensor(3.0))
    Scaled.factor = 4.0  # the instance attribute still shadows it
    assert torch.equal(_value_of(mod), torch.tensor(3.0))
    del obj.factor
    assert torch.equal(_value_of(mod), torch.tensor(4.0))


def test_same_tensor_twice_does_not_share_a_graph_input_with_two_tensors():
    def make(a, c):
        def mod(score, b, h, q_idx, kv_idx):
            return score + a[q_idx] - c[kv_idx]

        return mod

    shared = torch.randn(128)
    assert_graph_matches_mod(make(shared, shared), "score_mod")
    _, captured = assert_graph_matches_mod(make(torch.randn(128), torch.randn(128)), "score_mod")
    assert len(captured) == 2


def test_warm_calls_neither_trace_nor_search():
    slopes = torch.rand(4)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    module = BiasModule(torch.randn(128))
    holder = Holder(torch.randn(128))
    score_mods = [alibi, module, module.score_mod, holder.score_mod, default_mod, namespace_mod]
    mods = [(mod, "score_mod") for mod in score_mods] + [(torch_flex.or_masks(prefix(16), causal), "mask_mod")]
    for mod, kind in mods:
        trace_mod(mod, kind)
        traces, searches = trace.counts.traces, trace.counts.searches
        for _ in range(3):
            trace_mod(mod, kind)
        assert (trace.counts.traces, trace.counts.searches) == (traces, searches), mod
    # A bound method is a new object at every attribute access: its entry hangs on its object.
    searches = trace.counts.searches
    trace_mod(module.score_mod, "score_mod")
    trace_mod(holder.score_mod, "score_mod")
    assert trace.counts.searches == searches


def test_warm_path_table_is_bounded():
    alive = [lambda score, b, h, q_idx, kv_idx: score * 2 for _ in range(trace.cache._FAST_SIZE + 50)]
    for mod in alive:
        trace_mod(mod, "score_mod")
    assert len(trace.cache._FAST) <= trace.cache._FAST_SIZE


# ------------------------------------------------------------------------------- recycled ids


class Window:
    def __init__(self, size):
        self.size = size

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= self.size) & (q_idx >= kv_idx)


def test_recycled_ids_never_return_a_stale_entry():
    generator = torch.Generator().manual_seed(0)
    seen_ids, reused = {}, 0
    for step in range(150):
        size = int(torch.randint(1, 100, (), generator=generator))
        window = Window(size)
        reused += seen_ids.get(id(window), size) != size
        seen_ids[id(window)] = size
        assert_graph_matches_mod(window.mask_mod, "mask_mod", [(60, 60 - size), (60, 59 - size), (99, 0)])
        namespace = types.SimpleNamespace(table=torch.randn(int(torch.randint(100, 140, (), generator=generator))))
        globals()["NAMESPACE"] = namespace
        _, captured = assert_graph_matches_mod(namespace_mod, "score_mod", [(0, 99), (3, 7)])
        assert holds(captured, namespace.table)
        del window, namespace
        # The young generations only: this step's objects are young, and a full collection over the
        # suite's heap cost 0.7 s a step (110 s for the test in the full run). Ids come back as often.
        gc.collect(1)
    assert reused > 0, "no id came back for a Window of another size: the test proves nothing"


# ----------------------------------------------- contents the search cannot see are never stale


def test_tensor_in_an_object_without_visible_contents_is_never_stale():
    queue = deque([torch.randn(128)])

    def mod(score, b, h, q_idx, kv_idx):
        return score + queue[0][kv_idx]

    with pytest.warns(UserWarning, match="deque object.*traced again on every call"):
        _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, queue[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        queue[0].mul_(-2)
        _, captured = assert_graph_matches_mod(mod, "score_mod")
        queue[0] = torch.randn(128)
        _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, queue[0])


def test_tensor_reached_by_an_unsearched_path_is_a_live_input():
    def mod(score, b, h, q_idx, kv_idx):
        return score + mod.table[kv_idx]  # a function attribute: not among the reads found

    mod.table = torch.randn(128)
    with pytest.warns(UserWarning, match="path the search does not follow"):
        _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, mod.table)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod.table.add_(5)
        assert_graph_matches_mod(mod, "score_mod")
        mod.table = torch.randn(128)
        _, captured = assert_graph_matches_mod(mod, "score_mod")
    assert holds(captured, mod.table)


def test_untracked_tensor_gets_gradients(one_thread):
    table = torch.randn(128, dtype=torch.float64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score + mod.table[kv_idx]

    mod.table = table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert attention_in_float64(score_mod=mod, grad=(table,)) < 1e-10


def test_retraced_mods_share_one_traced_graph():
    queue = deque([torch.randn(128)])

    def mod(score, b, h, q_idx, kv_idx):
        return score + queue[0][kv_idx]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = trace_mod(mod, "score_mod")[0]
        queue[0] = torch.randn(128)
        second, captured = trace_mod(mod, "score_mod")
    assert first is second  # one TracedMod, so the kernel built for it is reused
    assert holds(captured, queue[0])
