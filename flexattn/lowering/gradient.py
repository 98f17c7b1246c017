"""A score_mod's gradient, lowered from its traced graph into Triton statements for the backward kernels.

The backward needs, per (query, key) pair, d out/d score and d out/d (every learnable captured tensor
the mod reads). We build one *joint graph* and lower it with the forward's walk (emit.py):

1. The forward graph is copied node for node, names kept, so the bounds decisions of the forward
   (``LoweringVariant``: int64 nodes, guarded gathers, keyed by node name) hold for it unchanged.
2. A *load site* is where a read of a learnable captured tensor ends in one value (``bias[h, q_idx -
   kv_idx]``, with any float casts of it). Each site is an input of the differentiation: the
   gradient at a site is added at the address its load read. A tensor read twice has two sites.
3. Reverse accumulation over the forward nodes, from the incoming gradient ``grad``: each node's
   vector-Jacobian product is torch's own derivative of that aten op, traced with ``make_fx`` on
   float32 examples (the kernel computes every float in float32) and decomposed into ops the
   lowering table knows; its nodes are appended to the joint graph. The forward ops those products
   recompute (``tanh(x)`` for tanh's derivative) are the same calls on the same nodes, so the walk's
   common-subexpression pass reads the forward's value instead of computing it twice.
4. The walk writes the joint graph's outputs: d out/d score, and per site its gradient, which an
   ``accumulate_captured_grad`` call (templates/mod_helpers.py.jinja) adds into a float32 buffer,
   reduced over the tile first where the address depends on fewer than both indices.

Captured tensors never require grad in these traces, so autograd never reaches a gather. A derivative
that cannot be lowered raises UnsupportedOpError at lowering time, naming the forward op and the
user's line and pointing to ``kernel_options={"BACKEND": "PYTORCH"}``.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.fx

from ..errors import UnsupportedOpError
from ..trace import CapturedInput, TracedMod
from .emit import ModInputs, _Emitter
from .index import print_index, sympy
from .ops import ALIASES, LOWERINGS, lookup, with_options
from .ranges import CONSERVATIVE_BOUNDS, LoweringVariant, graph_key, lowering_variant
from .sites import describe_site
from .values import Gather, Val, numel

__all__ = ["LoweredScoreGrad", "lower_score_grad", "DEPENDS_NONE", "DEPENDS_Q", "DEPENDS_KV", "DEPENDS_ALL"]

aten = torch.ops.aten
prims = torch.ops.prims

# What a site's address depends on (accumulate_captured_grad's DEPENDS): how far the helper can sum
# the tile before its atomics.
DEPENDS_NONE = 0  # only b / h: the whole tile adds into one element
DEPENDS_Q = 1  # the query index (and b / h): one element per query row
DEPENDS_KV = 2  # the key index: one element per key column
DEPENDS_ALL = 3  # both, or the score: one atomic per pair

_FALLBACK = (
    'The PyTorch backend differentiates any mod: flex_attention(..., kernel_options={"BACKEND": "PYTORCH"}).'
)
_STRUCTURAL = ("gather", "select", "view", "identity", "cast")


@dataclass(frozen=True)
class LoweredScoreGrad:
    """A score_mod's gradient as Triton source, for the backward kernels' ``score_mod_backward``.

    lines: statements, unindented (temporaries ``{prefix}t0, ...``).
    result: float32 expression, d loss/d score = ``grad * d mod/d score``, 0 where ``grad_keep`` is
        False; broadcastable to the tile.
    accumulate: statements (``accumulate_captured_grad(...)`` calls, one per address a gradient goes
        to) that add the learnable captured tensors' gradients into their buffers; may be empty.
    kernel_params: ``lower(traced, prefix=prefix).kernel_params`` (the captured tensors and strides,
        and the numbers, as the forward takes them), then ``{prefix}{name}_grad_ptr`` per trainable
        captured input.
    captured: ``TracedMod.captured``.
    trainable: indices into ``captured`` that have a gradient buffer, in the order of their params.
    """

    lines: tuple[str, ...]
    result: str
    accumulate: tuple[str, ...]
    kernel_params: tuple[str, ...]
    captured: tuple[CapturedInput, ...]
    trainable: tuple[int, ...]

    @property
    def body(self) -> str:
        return "\n".join(self.lines)

    @property
    def grad_params(self) -> tuple[str, ...]:
        """The gradient buffers' pointer parameters, one per ``trainable`` (the last of ``kernel_params``)."""
        return self.kernel_params[len(self.kernel_params) - len(self.trainable):]


# -- the joint graph -------------------------------------------------------------------------------


@dataclass
class _Site:
    node: torch.fx.Node  # joint-graph node whose value is the loaded element (after float casts)
    captured: int  # index into traced.captured
    chain: tuple[str, ...]  # names of the nodes from the placeholder to the site
    depends: int


@dataclass
class _Joint:
    graph_module: torch.fx.GraphModule
    sites: list[_Site]
    grad_outputs: list[Optional[torch.fx.Node]]  # [d score, d site 0, d site 1, ...] (None: zero)


def _kernel_example(val) -> torch.Tensor:
    """A tensor like ``val`` as the kernel holds it: every float is float32. A Python number the mod
    reads (a graph input: trace/numbers.py) is a 0-d tensor of its kind, as the kernel holds it."""
    if not isinstance(val, torch.Tensor):
        return torch.zeros((), dtype=torch.bool if type(val) is bool else torch.int32 if type(val) is int else torch.float32)
    dtype = torch.float32 if val.dtype.is_floating_point else val.dtype
    return torch.zeros(tuple(val.shape), dtype=dtype)


def _plain_meta(val):
    if isinstance(val, torch.Tensor):
        return torch.empty(tuple(val.shape), dtype=val.dtype)
    return val


# Decompositions for what the derivative formulas call that the table lacks (tanh_backward,
# sigmoid_backward, threshold_backward, ...): torch's own, into ops the table has. Built lazily: the
# table may grow (register_lowering).
def _decompositions(table: dict) -> dict:
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if lookup(op, table) is None}


class _NoDerivative(Exception):
    pass


_vjp_cache: "OrderedDict[Any, torch.fx.GraphModule]" = OrderedDict()
_vjp_lock = threading.Lock()
_VJP_KEPT = 512


def _structure_key(arg):
    """The op's arguments with each tensor replaced by its (shape, kernel dtype): the cache key."""
    if isinstance(arg, torch.fx.Node):
        val = _kernel_example(arg.meta["val"])
        return ("T" if isinstance(arg.meta["val"], torch.Tensor) else "N", tuple(val.shape), val.dtype)
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_structure_key(a) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _structure_key(v)) for k, v in arg.items()))
    return (type(arg).__name__, repr(arg))


def _vjp_graph(target, node: torch.fx.Node, active: tuple[bool, ...], table: dict) -> torch.fx.GraphModule:
    """``(*tensor inputs of node, gy) -> grads of the active inputs`` as an aten graph (cached)."""
    examples = [_kernel_example(n.meta["val"]) for n in _nodes_of(node)]
    gy_example = _kernel_example(node.meta["val"])
    # The table decides the decompositions; the default tables are keyed by identity.
    table_key = id(table) if table is LOWERINGS else tuple(sorted(map(str, table)))
    key = (target, _structure_key(node.args), _structure_key(dict(node.kwargs)), active, table_key)
    with _vjp_lock:
        cached = _vjp_cache.get(key)
        if cached is not None:
            _vjp_cache.move_to_end(key)
            return cached

    # A number the mod reads is an input of the formula too (its value changes between calls): a 0-d
    # tensor there, so the op is called by its packet, which picks the overload taking a tensor.
    call = target
    if any(not isinstance(n.meta.get("val"), torch.Tensor) for n in _nodes_of(node)):
        call = getattr(target, "overloadpacket", target)

    def fn(*xs):
        *ins, gy = xs
        it = iter(ins)
        args = torch.fx.node.map_arg(list(node.args), lambda _n: next(it))
        kwargs = torch.fx.node.map_arg(dict(node.kwargs), lambda _n: next(it))
        out = call(*args, **kwargs)
        wanted = [x for x, a in zip(ins, active) if a]
        if not out.requires_grad:
            return tuple(None for _ in wanted)
        return torch.autograd.grad(out, wanted, gy, allow_unused=True)

    from torch.fx.experimental.proxy_tensor import make_fx

    decompositions = _decompositions(table)
    inputs = [e.clone().requires_grad_(a and e.dtype.is_floating_point) for e, a in zip(examples, active)]
    try:
        # Grad mode on whatever the caller's: the lowering can run where autograd has turned it off
        # (a compiled graph's backward runs its ops without grad), and tracing autograd.grad there
        # would give every derivative as None, that is 0, and cache it for every later mod.
        with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
            warnings.simplefilter("always")
            traced = make_fx(fn, decomposition_table=decompositions, tracing_mode="fake")(*inputs, gy_example)
        for w in caught:  # an op without an autograd formula: torch warns and gives no gradient
            if "autograd kernel was not registered" in str(w.message):
                raise _NoDerivative(f"{target} has no autograd formula")
        # Some derivative formulas write into temporaries (clamp's logical_and_, maximum's copy_):
        # functionalize them so every node is a value.
        functional = make_fx(torch.func.functionalize(traced, remove="mutations"),
                             decomposition_table=decompositions, tracing_mode="fake")(*examples, gy_example)  # fmt: skip
    except _NoDerivative:
        raise
    except Exception as err:  # no derivative formula, or one that cannot be traced
        raise _NoDerivative(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
    with _vjp_lock:
        _vjp_cache[key] = functional
        if len(_vjp_cache) > _VJP_KEPT:
            _vjp_cache.popitem(last=False)
    return functional


def _is_float_node(node) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dtype.is_floating_point


class _JointBuilder:
    def __init__(self, traced: TracedMod, table: dict, raise_error):
        self.traced = traced
        self.table = table
        self.raise_error = raise_error  # (forward node, problem, hint) -> raises
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}  # forward node -> its copy

    def trainable(self) -> list[int]:
        return [i for i, c in enumerate(self.traced.captured) if c.requires_grad and c.fixed_value is None]

    def build(self) -> _Joint:
        fwd = self.traced.graph
        n_args = len(self.traced.arg_names)
        placeholders = [n for n in fwd.nodes if n.op == "placeholder"]
        trainable = set(self.trainable())

        # Which nodes read a learnable tensor without computing on it yet (its chain), and where each
        # such read ends in one value (its site).
        chain: dict[torch.fx.Node, int] = {}
        for position, node in enumerate(placeholders):
            if position >= n_args and position - n_args in trainable:
                chain[node] = position - n_args
        for node in fwd.nodes:
            if node.op != "call_function" or not node.args or node.args[0] not in chain:
                continue
            rule = lookup(node.target, self.table)
            if rule is None or rule.kind not in _STRUCTURAL:
                continue
            if rule.kind == "cast" and not node.meta["val"].dtype.is_floating_point:
                continue  # an integer read of a float tensor: not differentiable, an ordinary op
            if rule.kind == "identity" and node.target in (aten.detach.default,):
                continue
            chain[node] = chain[node.args[0]]

        depends = self.dependencies()
        output = next(n for n in fwd.nodes if n.op == "output")
        (out,) = output.args
        sites: list[_Site] = []
        site_of: dict[torch.fx.Node, int] = {}
        for node in fwd.nodes:
            if node not in chain or node.op == "placeholder":
                continue
            computed_on = [u for u in node.users if u not in chain or u.op == "output"] + ([output] if node is out else [])
            if not computed_on:
                continue
            if numel(node.meta["val"].shape) != 1:
                if any(_is_float_node(u) for u in computed_on if u.op == "call_function") or node is out:
                    c = self.traced.captured[chain[node]]
                    self.raise_error(
                        node, f"the learnable captured tensor '{c.name}' read as a tensor of shape "
                        f"{tuple(node.meta['val'].shape)}",
                        "The Triton backward differentiates reads of one element (bias[h, q_idx - kv_idx]); "
                        "index a learnable tensor down to one element before computing with it.",
                    )  # fmt: skip
                continue
            names = []
            walk = node
            while walk in chain:
                names.append(walk.name)
                if walk.op == "placeholder":
                    break
                walk = walk.args[0]
            site_of[node] = len(sites)
            sites.append(_Site(node, chain[node], tuple(reversed(names)), depends[node]))

        # Which nodes the differentiation goes through: float values computed from the score or a site.
        score = placeholders[self.traced.arg_names.index("score")]
        active: set[torch.fx.Node] = {score, *site_of}
        for node in fwd.nodes:
            if node.op == "call_function" and node not in chain and _is_float_node(node):
                if any(a in active for a in _nodes_of(node)):
                    active.add(node)

        # The joint graph: the forward, names kept, then the incoming gradient and the derivatives.
        for node in placeholders:
            self.env[node] = self.graph.node_copy(node, lambda n: self.env[n])
        grad = self.graph.placeholder("flexattn_grad_in")
        grad.meta["val"] = torch.empty((), dtype=torch.float32)
        for node in fwd.nodes:
            if node.op == "call_function":
                self.env[node] = self.graph.node_copy(node, lambda n: self.env[n])
                if node.name != self.env[node].name:
                    raise AssertionError(f"joint graph renamed {node.name} to {self.env[node].name}")

        adjoints: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        if isinstance(out, torch.fx.Node) and out in active:
            adjoints[out] = [grad]
        for node in reversed(list(fwd.nodes)):
            if node.op != "call_function" or node in chain or node not in active or node not in adjoints:
                continue
            total = self.total(adjoints[node], node)
            rule = lookup(node.target, self.table)
            inputs = _nodes_of(node)
            if rule is not None and rule.kind == "cast":
                # A float -> float cast passes the gradient on unrounded (the buffers are float32).
                if inputs and inputs[0] in active:
                    adjoints.setdefault(inputs[0], []).append(total)
                continue
            flags = tuple(n in active for n in inputs)
            if not any(flags):
                continue
            for i, g in zip([i for i, f in enumerate(flags) if f], self.vjp(node, inputs, flags, total)):
                if g is not None:
                    adjoints.setdefault(inputs[i], []).append(g)

        results = [self.total(adjoints[score], score) if score in adjoints else None]
        results += [self.total(adjoints[s.node], s.node) if s.node in adjoints else None for s in sites]
        # The sites' reads are outputs too, so that dead-code elimination keeps them: the walk writes
        # their addresses even where the derivative does not need the value read.
        self.graph.output(tuple(results) + tuple(self.env[s.node] for s in sites))
        self.graph.eliminate_dead_code()
        gm = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        for s in sites:
            s.node = self.env[s.node]
        return _Joint(gm, sites, results)

    def dependencies(self) -> dict[torch.fx.Node, int]:
        """Per forward node: which index arguments its value depends on, as a DEPENDS_* code. A value
        read from a captured tensor depends on what its indices depend on."""
        names = {"q_idx": 1, "kv_idx": 2, "score": 3}
        bits: dict[torch.fx.Node, int] = {}
        position = 0
        for node in self.traced.graph.nodes:
            if node.op == "placeholder":
                arg = self.traced.arg_names[position] if position < len(self.traced.arg_names) else None
                bits[node] = names.get(arg, 0)
                position += 1
            elif node.op == "call_function":
                b = 0
                for n in _nodes_of(node):
                    b |= bits.get(n, 3)
                if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                    b = 3
                bits[node] = b
        return bits

    def total(self, items: list[torch.fx.Node], like: torch.fx.Node) -> torch.fx.Node:
        acc = items[0]
        for item in items[1:]:
            shape = torch.broadcast_shapes(tuple(acc.meta["val"].shape), tuple(item.meta["val"].shape))
            node = self.graph.call_function(aten.add.Tensor, (acc, item))
            node.meta["val"] = torch.empty(shape, dtype=torch.float32)
            node.meta["flexattn_forward"] = like.name
            acc = node
        return acc

    def vjp(self, node: torch.fx.Node, inputs: list, flags: tuple, total: torch.fx.Node) -> list:
        target = node.target
        # A library op that means an aten op (attention-gym's approx::tanh) has that op's derivative.
        alias = ALIASES.get(getattr(getattr(target, "_schema", None), "name", None))
        if alias is not None:
            target = alias.default if isinstance(alias, torch._ops.OpOverloadPacket) else alias
        try:
            gm = _vjp_graph(target, node, flags, self.table)
        except _NoDerivative as err:
            self.raise_error(node, f"no derivative torch can trace ({err})", None)
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for p, value in zip(ph, [self.env[n] for n in inputs] + [total]):
            env[p] = value
        grads = None
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                grads = list(torch.fx.node.map_arg(n.args[0], lambda m: env[m]))
                break
            if n.target is aten.copy.default:  # functionalized `dst.copy_(src)`: src in dst's dtype
                dst, src = (env[a] for a in n.args[:2])
                env[n] = self.cast(src, n.meta["val"], node)
                continue
            if n.target in (target, node.target) and _same_args(torch.fx.node.map_arg(n.args, lambda m: env[m]),
                                                                self.env[node].args):
                env[n] = self.env[node]  # the forward value the formula needs: read it, not recompute it
                continue
            copy = self.graph.node_copy(n, lambda m: env[m])
            copy.meta = {"val": _plain_meta(n.meta.get("val")), "flexattn_forward": node.name}
            env[n] = copy
        return grads

    def cast(self, src: torch.fx.Node, val: torch.Tensor, forward: torch.fx.Node) -> torch.fx.Node:
        node = src
        if src.meta["val"].dtype != val.dtype:
            node = self.graph.call_function(prims.convert_element_type.default, (node, val.dtype))
            node.meta = {"val": torch.empty(tuple(src.meta["val"].shape), dtype=val.dtype), "flexattn_forward": forward.name}
        if tuple(node.meta["val"].shape) != tuple(val.shape):
            expanded = self.graph.call_function(aten.expand.default, (node, list(val.shape)))
            expanded.meta = {"val": torch.empty(tuple(val.shape), dtype=val.dtype), "flexattn_forward": forward.name}
            node = expanded
        return node


def _nodes_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


# -- writing it ------------------------------------------------------------------------------------


class _GradEmitter(_Emitter):
    extra_inputs = 1  # the incoming gradient, after the captured tensors

    def __init__(self, traced: TracedMod, joint: _Joint, inputs: ModInputs, prefix: str, table: dict,
                 variant: LoweringVariant):  # fmt: skip
        super().__init__(replace(traced, graph_module=joint.graph_module), inputs, prefix, table, variant)
        self.original = traced
        self.joint = joint
        self.forward_nodes = {n.name: n for n in traced.graph.nodes}
        self.chain_names = {name for s in joint.sites for name in s.chain}
        self.loaded: dict[torch.fx.Node, Gather] = {}  # fully indexed reads of learnable tensors

    def extra_input(self, position: int) -> Val:
        return Val("grad", torch.float32)

    def settle_node(self, node: torch.fx.Node, value):
        if isinstance(value, Gather) and not value.dims and node.name in self.chain_names:
            # The gradient is added where this load read: name its index once for both.
            value = replace(value, offset=self.name_inline_symbols(value.offset))
            self.loaded[node] = value
        return super().settle_node(node, value)

    def result(self, node: torch.fx.Node):
        (outs,) = node.args
        outs = outs[: 1 + len(self.joint.sites)]  # the rest only keep the sites' reads alive
        return [None if o is None else self.value_of(o, node) for o in outs]

    def lower(self) -> LoweredScoreGrad:
        values = self.walk()
        d_score, d_sites = values[0], values[1:]
        if d_score is None:
            result = "tl.full([1, 1], 0.0, tl.float32)"
        else:
            result = f"tl.where(grad_keep, {self.coerce(d_score, torch.float32).text}, 0.0)"
        trainable = tuple(i for i, c in enumerate(self.traced.captured) if c.requires_grad and c.fixed_value is None)
        grouped: dict[tuple, list[str]] = {}
        by_name = {n.name: n for n in self.traced.graph.nodes}
        for site, value in zip(self.joint.sites, d_sites):
            if value is None or (value.value is not None and value.value == 0):
                continue
            g = self.site_gather(site, by_name)
            ptr, offset, keep = self.grad_address(site.captured, g)
            grouped.setdefault((ptr, offset, keep, site.depends), []).append(self.coerce(value, torch.float32).text)
        accumulate = []
        for (ptr, offset, keep, depends), values in grouped.items():
            total = " + ".join(f"({v})" if len(values) > 1 else v for v in values)
            # The offset goes apart from the base: see [Note] Few addresses in mod_helpers.py.jinja.
            # DETERMINISTIC is score_mod_backward's (the deterministic backward).
            if offset is None:  # the first element, whatever the pair: the tile sums to one atomic
                accumulate.append(f"accumulate_captured_grad({ptr}, 0, {total}, {keep}, {DEPENDS_NONE}, Q_AXIS, "
                                  "DETERMINISTIC)")
            elif depends == DEPENDS_ALL:
                accumulate.append(f"accumulate_captured_grad_pairs({ptr}, {offset}, {total}, {keep}, DETERMINISTIC)")
            else:
                accumulate.append(f"accumulate_captured_grad({ptr}, {offset}, {total}, {keep}, {depends}, Q_AXIS, "
                                  "DETERMINISTIC)")
        accumulate = tuple(accumulate)
        params = [p for i in range(len(self.traced.captured)) for p in self.params(i)]
        params += list(self.number_params())
        params += [self.grad_param(i) for i in trainable]
        return LoweredScoreGrad(tuple(self.lines), result, accumulate, tuple(params), tuple(self.traced.captured),
                                trainable)  # fmt: skip

    def grad_param(self, i: int) -> str:
        return f"{self.prefix}{self.traced.captured[i].name}_grad_ptr"

    def site_gather(self, site: _Site, by_name: dict) -> Gather:
        for name in reversed(site.chain):
            g = self.loaded.get(self.canonical.get(by_name.get(name)))
            if g is not None:
                return g
        raise AssertionError(f"no load recorded for the read at {site.node.name}")

    def grad_address(self, i: int, g: Gather) -> tuple[str, Optional[str], str]:
        """Where the gradient buffer of captured ``i`` (float32, contiguous) holds the element ``g`` read
        (its pointer, and the element offset or None for the first element), and when the gradient
        counts there (``grad_keep`` and the read's in-range checks)."""
        c = self.traced.captured[i]
        contiguous, step = [], 1
        for size in reversed(c.shape):
            contiguous.append(step)
            step *= int(size)
        contiguous.reverse()
        strides = {self.symbol(p, torch.int32): sympy.Integer(s) for p, s in zip(self.params(i)[1:], contiguous)}
        offset = sympy.expand(g.offset.xreplace(strides))
        ptr = self.grad_param(i)
        text = None
        if offset != 0:
            wide = g.wide or any(self.sym_dtypes.get(s) == torch.int64 for s in offset.free_symbols)
            text, _ = print_index(offset, self.names, frozenset(self.strides), dtypes=self.sym_dtypes, wide=wide)
        keep = " & ".join(["grad_keep", *g.checks])
        return ptr, text, keep

    # -- errors: name the forward op whose derivative failed, and the way around it ----------------

    def forward_node(self, node: torch.fx.Node) -> Optional[torch.fx.Node]:
        name = node.meta.get("flexattn_forward", node.name)
        return self.forward_nodes.get(name)

    def where(self, node: torch.fx.Node) -> list[str]:
        forward = self.forward_node(node)
        if forward is None:
            return ["  at an unknown line"]
        lines = [f"  {line}" for line in describe_site(self.original, forward)]
        if forward.name != node.name:
            lines.insert(0, f"  in the derivative of {forward.target} ({forward.name})")
        return lines

    def _for_gradient(self, err: UnsupportedOpError) -> UnsupportedOpError:
        text = str(err).replace(f"Cannot lower {self.traced.kind} ", f"Cannot lower the gradient of {self.traced.kind} ", 1)
        return UnsupportedOpError(f"{text}\n  {_FALLBACK}")

    def unsupported(self, node, problem, hint=None) -> UnsupportedOpError:
        return self._for_gradient(super().unsupported(node, problem, hint))

    def unknown_op(self, node) -> UnsupportedOpError:
        return self._for_gradient(super().unknown_op(node))


def lower_score_grad(
    traced: TracedMod,
    *,
    prefix: str = "sm_",
    tanh_approx: bool = False,
    variant: Optional[LoweringVariant] = None,
) -> LoweredScoreGrad:
    """The gradient of a traced score_mod as Triton source for ``score_mod_backward`` (module docstring).

    ``prefix``, ``tanh_approx`` and ``variant`` as for ``lower``: pass the same values as the forward
    of the same call, so the kernel parameters and the bounds decisions agree. Deterministic: the same
    graph, captured shapes and options give the same source. Raises UnsupportedOpError, naming the
    op and the mod's source line, for a derivative the Triton kernels cannot compute.
    """
    if traced.kind != "score_mod":
        raise ValueError(f"lower_score_grad takes a traced score_mod, got a {traced.kind} ('{traced.name}')")
    if not prefix.isidentifier():
        raise ValueError(f"prefix must start a Python identifier, got {prefix!r}")
    if variant is None:
        variant = lowering_variant(traced, CONSERVATIVE_BOUNDS)
    elif not isinstance(variant, LoweringVariant):
        raise TypeError(f"variant must come from lowering_variant(traced, bounds), got {type(variant).__name__}")
    elif variant.graph is not None and variant.graph != graph_key(traced):
        raise ValueError(f"variant was computed for another mod than {traced.kind} '{traced.name}': "
                         "pass lowering_variant(traced, bounds) of this traced mod")  # fmt: skip
    table = with_options(tanh_approx=tanh_approx)
    inputs = ModInputs()

    def refuse(node: torch.fx.Node, problem: str, hint: Optional[str]):
        lines = [f"Cannot lower the gradient of {traced.kind} '{traced.name}' to Triton: {node.target} with {problem}.",
                 *(f"  {line}" for line in describe_site(traced, node))]  # fmt: skip
        if hint:
            lines.append(f"  {hint}")
        lines.append(f"  {_FALLBACK}")
        raise UnsupportedOpError("\n".join(lines))

    joint = _JointBuilder(traced, table, refuse).build()
    return _GradEmitter(traced, joint, inputs, prefix, table, variant).lower()


def _same_args(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    return type(a) is type(b) and a == b
