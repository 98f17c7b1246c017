"""Where in the user's source a graph node came from, for the lowering's error messages.

The mod is run again eagerly on 0-d tensors under a dispatch mode that stops at the matching call of
the node's op and reads the Python stack there. Of the frames between that call and the mod's entry,
the innermost one outside torch is the user's line. When the op is called by a library function
(the body of torch's ``or_masks``), that function is named as well, with the user's line that called
it or, when the whole mod is library code, the user's functions it combines and where they are
defined. flexattn's own frames never count: they are the caller, not the mod.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..trace import GetItemToIndex, TracedMod

__all__ = ["describe_site"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FLEXATTN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_VARIANTS_DIR = os.path.join(_FLEXATTN_DIR, "variants") + os.sep


@dataclass(frozen=True)
class _Frame:
    path: str
    lineno: int
    name: str  # qualified name of the function (or_masks.<locals>.or_mask)
    module: str

    @property
    def text(self) -> str:
        return linecache.getline(self.path, self.lineno).strip()

    def where(self) -> str:
        return f"{self.path}:{self.lineno} (in {self.name}): {self.text}"


def _is_torch(path: str) -> bool:
    return path.startswith(_TORCH_DIR)


def _is_plumbing(path: str) -> bool:
    """torch's machinery between a call and its aten op (operators, dispatch, overrides)."""
    if not _is_torch(path):
        return False
    relative = path[len(_TORCH_DIR):]
    first = relative.split(os.sep)[0]
    return first.startswith("_") or relative == "overrides.py" or relative.startswith(os.path.join("utils", "_"))


def _is_ours(path: str) -> bool:
    # The catalogue's mods (flexattn/variants) are mods like a user's: an error names their lines.
    if path.startswith(_VARIANTS_DIR):
        return False
    return path.startswith(_FLEXATTN_DIR) or path.startswith("<frozen")


def _frame(f: types.FrameType) -> _Frame:
    code = f.f_code
    return _Frame(os.path.abspath(code.co_filename), f.f_lineno, getattr(code, "co_qualname", code.co_name),
                  f.f_globals.get("__name__", "?"))  # fmt: skip


def _run_mod(fn: Callable, args: list):
    # Its code object marks where the mod's own frames start on the stack.
    return fn(*args)


class _StopAtCall(TorchDispatchMode):
    """Records the Python frames inside the mod at the ``occurrence``-th call of ``target``."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as trace._GraphRecorder: never under torch.compile, so skip Dynamo's guard

    def __init__(self, target, occurrence: int):
        super().__init__()
        self.target, self.occurrence, self.seen = target, occurrence, 0
        self.frames: Optional[list[_Frame]] = None  # innermost first

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.target:
            if self.seen == self.occurrence and self.frames is None:
                frames, f = [], sys._getframe(1)
                while f is not None and f.f_code is not _run_mod.__code__:
                    frames.append(_frame(f))
                    f = f.f_back
                self.frames = frames
            self.seen += 1
        return func(*args, **(kwargs or {}))


def _example_args(kind: str, device: str) -> list[torch.Tensor]:
    indices = [torch.tensor(v, dtype=torch.int32, device=device) for v in (0, 0, 1, 1)]
    score = [torch.tensor(0.5, dtype=torch.float32, device=device)] if kind == "score_mod" else []
    return score + indices


def _frames_at(traced: TracedMod, node: torch.fx.Node) -> Optional[list[_Frame]]:
    occurrence = 0
    for other in traced.graph.nodes:
        if other is node:
            break
        if other.op == "call_function" and other.target is node.target:
            occurrence += 1
    for device in ("cpu", "meta"):  # meta: a mod whose gathers are out of range at the example values
        stop = _StopAtCall(node.target, occurrence)
        try:
            with torch.no_grad(), GetItemToIndex(), stop:
                _run_mod(traced.fn, _example_args(traced.kind, device))
        except Exception:
            pass
        if stop.frames:
            return [f for f in stop.frames if not _is_ours(f.path)]
    return None


def _user_functions(fn: Callable) -> list[str]:
    """The non-library functions a library-built mod closes over (the mods inside torch's or_masks)."""
    found, seen = [], set()

    def visit(obj, depth):
        if depth > 3 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
            path = os.path.abspath(code.co_filename)
            if not _is_torch(path) and not _is_ours(path):
                found.append(f"{obj.__name__} (defined at {path}:{code.co_firstlineno})")
                return
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:
                    pass
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item, depth + 1)

    visit(fn, 0)
    return found


def _caller_outside() -> Optional[_Frame]:
    """The innermost frame of the current stack outside flexattn and torch: where the user called us."""
    f = sys._getframe(1)
    while f is not None:
        frame = _frame(f)
        if not _is_ours(frame.path) and not _is_torch(frame.path):
            return frame
        f = f.f_back
    return None


def describe_site(traced: TracedMod, node: torch.fx.Node) -> list[str]:
    """Lines (unindented) that say where ``node`` came from in the user's source."""
    frames = _frames_at(traced, node)
    if not frames:
        return ["at an unknown line"]
    meaningful = [f for f in frames if not _is_plumbing(f.path)]  # innermost first
    user = next((i for i, f in enumerate(meaningful) if not _is_torch(f.path)), None)
    if user == 0:
        return [f"at {meaningful[0].where()}"]
    if not meaningful:
        return ["at an unknown line"]
    # The op is called inside library code: name the outermost library function below the user's frame.
    library = meaningful[(user if user is not None else len(meaningful)) - 1]
    lines = [f"at {library.where()}",
             f"inside the library function {library.module}.{library.name}"]  # fmt: skip
    if user is not None:
        lines[-1] += f", called at {meaningful[user].where()}"
    else:
        parts = _user_functions(traced.fn)
        if parts:
            lines[-1] += f"; the {traced.kind} combines {', '.join(parts)}"
        caller = _caller_outside()
        if caller is not None:
            lines.append(f"the {traced.kind} was passed in at {caller.where()}")
    return lines
