"""What tracing gives the later stages: a TracedMod (an fx graph, the tensors and the Python numbers
it reads) and the calling conventions of score_mods and mask_mods."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..cuda_graphs import copied_outside_graph_pools
from .numbers import evaluate

__all__ = [
    "SCORE_MOD_ARGS", "MASK_MOD_ARGS", "ARGS_OF_KIND", "INDEX_DTYPE", "SCORE_DTYPE", "CapturedInput",
    "CapturedNumber", "TracedMod", "counts", "NUMBER_INT_LIMIT", "needs_grad", "detached",
]

SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")
ARGS_OF_KIND = {"score_mod": SCORE_MOD_ARGS, "mask_mod": MASK_MOD_ARGS}

# Index tensors are int32, as in the kernels; scores are float32, the kernels' working precision.
INDEX_DTYPE = torch.int32
SCORE_DTYPE = torch.float32


# The ints a graph takes as inputs are those with |value| <= NUMBER_INT_LIMIT: the lowering decides
# int32 or int64 arithmetic for every value in that range at once (lowering/ranges.py), so one
# kernel serves them all, with int32 arithmetic wherever the indices' own would be (q_idx + n stays
# int32 at any length below 2**31 - 2**24). A larger value is traced as a constant (cache.py).
NUMBER_INT_LIMIT = 2**24


class Counts:
    """How many full searches of a callable's reads and real traces ran in this process (tests check
    that warm calls add none)."""

    searches = 0
    traces = 0


counts = Counts()


@dataclass(frozen=True)
class CapturedInput:
    """A tensor the mod reads that is not one of its arguments: a graph input after the mod's args."""

    name: str  # readable, from the closure variable or global it was found under ("doc_id")
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    walk_index: Optional[int]  # position among the tensors found in the callable, None if fixed
    fixed_value: Optional[torch.Tensor] = None  # a tensor the mod builds itself, frozen at trace time


@dataclass(frozen=True)
class CapturedNumber:
    """A Python number the mod reads (a window size in a closure, a soft-cap in a global, an
    attribute of an object): a graph input after the captured tensors, and a runtime argument of
    the kernels, so a new value reuses the kernels compiled for the last one (numbers.py).

    ``expr`` says how the value is computed from the numbers the search found (``("leaf", i)``, or
    Python arithmetic on them, ``("floordiv", ("leaf", 0), ("const", 2))``); ``kind`` is its Python
    type, which the kernels' argument has: int, float or bool."""

    name: str
    kind: type
    expr: tuple


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the trace caches keep one per graph
class TracedMod:
    """One traced mod: an fx graph with placeholders ``arg_names + captured + numbers``, all 0-d but
    gathers (numbers: Python values).

    ``specialized``: the numbers found whose value this graph depends on beyond what it reads at
    run time (the mod branched on them in Python, or used them as a shape), with those values: the
    graph is right only for calls where they hold (``(leaf, type, value)`` each)."""

    kind: str  # "score_mod" or "mask_mod"
    name: str  # the callable's __name__, used in errors and kernel cache keys
    fn: Callable
    graph_module: torch.fx.GraphModule
    arg_names: tuple[str, ...]
    captured: tuple[CapturedInput, ...]
    numbers: tuple[CapturedNumber, ...] = ()
    specialized: tuple[tuple[int, type, Any], ...] = ()

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def captured_values(self, found: list[torch.Tensor], leaves: tuple = ()) -> list:
        """The graph's captured inputs for this call: its tensors, from the tensors found in the
        callable now, then its numbers, from the numbers found there now (``leaves``)."""
        values = [c.fixed_value if c.walk_index is None else found[c.walk_index] for c in self.captured]
        if self.numbers:  # most mods read none: no generator to run
            values.extend(evaluate(n.expr, leaves, found) for n in self.numbers)
        return values

    def fixed_values_on(self, device: torch.device) -> tuple[Optional[torch.Tensor], ...]:
        """The constants this mod builds itself (frozen on the CPU when it was traced), one per
        captured input (None for the user's tensors), on ``device``: copied once per device and kept
        on this object, so no launch copies them again (nor during CUDA-graph capture). The
        constants are this object's own clones; the version check guards a copy anyway."""
        device = torch.device(device)
        copies = self.__dict__.setdefault("_fixed_on_device", {})
        # flexattn's own clones: nothing else writes them, so one made under inference_mode (no
        # version counter) is kept as it is.
        versions = tuple(None if c.fixed_value is None else 0 if c.fixed_value.is_inference() else c.fixed_value._version
                         for c in self.captured)
        entry = copies.get(device)
        if entry is None or entry[0] != versions:
            constants = tuple(c.fixed_value for c in self.captured)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # no copy kept from before: for this call only, in the graph's pool
                return tuple(None if t is None else t.to(device) for t in constants)
            # Copied by a worker thread, which waits for the copies: outside any graph tree's pool,
            # and done before a call on any stream reads them (flexattn/cuda_graphs.py).
            values = copied_outside_graph_pools(constants, device)
            entry = copies[device] = (versions, values)
        return entry[1]

    def signature_text(self) -> str:
        """A stable text of the graph, for cache keys of generated kernels."""
        return self.graph_module.code

    def content_text(self) -> str:
        """Everything a kernel generated for this mod depends on, as text, the same in any process:
        for keys kept on disk or shared between processes (the kernel index, compile/registry.py's call
        keys)."""
        text = self.__dict__.get("_content_text")
        if text is None:
            fixed = [None if c.fixed_value is None else (str(c.fixed_value.dtype), c.fixed_value.cpu().flatten().tolist())
                     for c in self.captured]
            spec = [(c.name, tuple(c.shape), str(c.dtype), c.requires_grad, c.walk_index) for c in self.captured]
            numbers = [(n.name, n.kind.__name__, n.expr) for n in self.numbers]
            specialized = [(i, t.__name__, repr(v)) for i, t, v in self.specialized]
            text = repr((self.kind, self.name, self.signature_text(), spec, fixed, numbers, specialized))
            self.__dict__["_content_text"] = text
        return text

    def graph_module_on(self, device: torch.device) -> torch.fx.GraphModule:
        """The graph with its factory calls (``b.new_ones(())``, ``torch.full(..., device=b.device)``)
        placed on ``device``: tracing ran on CPU tensors, so the graph records ``device=cpu``, and a
        PyTorch-backend run on a GPU would mix devices. One copy per device, kept on this object."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.graph_module
        copies = self.__dict__.setdefault("_graph_on_device", {})
        gm = copies.get(device)
        if gm is None:
            gm = copy.deepcopy(self.graph_module)
            for node in gm.graph.nodes:
                placed = node.kwargs.get("device")
                if isinstance(placed, torch.device) and placed.type == "cpu":
                    node.kwargs = {**node.kwargs, "device": device}
            gm.recompile()
            copies[device] = gm
        return gm


def needs_grad(values) -> bool:
    """Whether a tensor among a mod's captured values (tensors, then numbers) requires grad."""
    for v in values:  # a loop, not any(generator): this runs on every call
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    return False


def detached(values) -> list:
    """A mod's captured values with the tensors detached (a mask_mod's take no gradient)."""
    return [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
