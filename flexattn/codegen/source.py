"""Codegen: plain values -> kernel source, written to the cache directory and imported as a module.

Stage 3 of the pipeline (trace -> lowering -> codegen -> kernels). Templates take plain values
only (the lowered mods' lines and parameter names, and the declarations of codegen/params.py), so a
template can be read on its own. Each
rendered kernel is written under a readable, content-addressed name, e.g.
``fwd_alibi_causal_3f2a9c01d4e5b677.py``, and imported from there: Triton's ``@jit`` needs a real
file, and a file is what a user opens when a kernel misbehaves. ``FLEXATTN_DEBUG=1`` prints where.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Optional

from ..lowering import LoweredMod
from .params import TEMPLATE_GROUPS, mods_group

__all__ = ["FAMILIES", "KernelSpec", "render", "cache_dir", "load_kernel_module", "debug_enabled", "KernelIndex",
           "counts"]

TEMPLATE_DIR = Path(__file__).parent.parent / "templates"



@cache
def _templates():
    """The templates' environment, made at the first render: a process whose kernels all come from
    the disk cache renders nothing, and importing jinja2 (its lexer compiles large regular
    expressions) is a measurable share of ``import flexattn``."""
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,  # a missing value is a bug in codegen, not an empty string
        keep_trailing_newline=True,
        autoescape=False,
    )
    environment.filters["gluon_spelling"] = gluon_spelling
    return environment


# [Note] Gluon spelling. The mods' lowered lines are written for Triton's language; the Gluon
# template calls them from @gluon.jit code, where Triton 3.6 compiles them with Gluon's semantics.
# Two of the calls the lowering writes need a layout there: tl.full gets the template's full_auto
# (Gluon's full with the layout left to the compiler) and tl.zeros_like Gluon's own, which takes
# its argument's layout. Anything else Gluon lacks fails to compile, and the call runs the
# portable forward (kernels/hopper/forward.py).
_GLUON_SPELLING = (("tl.full(", "full_auto("), ("tl.zeros_like(", "gl.zeros_like("))


def gluon_spelling(text: str) -> str:
    """Lowered Triton text as the Gluon template calls it (see [Note] Gluon spelling)."""
    for triton_name, gluon_name in _GLUON_SPELLING:
        text = text.replace(triton_name, gluon_name)
    return text



# [Note] Gluon API by Triton release. Gluon is experimental and renames its ops between releases;
# the Hopper templates spell the ones that moved through ``gluon_api`` (chosen here at render time
# from the installed Triton), so under Triton 3.6 their source is what it always was. Each entry is
# the first release of a spelling, and holds until the next entry:
# - 3.7: gl.thread_barrier -> gl.barrier (the same barrier within a CTA; 3.7 drops the old name);
# - 3.8: tma.async_copy_global_to_shared -> tma.async_load and tma.async_copy_shared_to_global ->
#   tma.async_store (3.8 keeps the old names as aliases; 3.9 removes them), and the copy engine's
#   reduce-add, which 3.6's builder has without a Gluon name (the template's tma_reduce_add), becomes
#   tma.async_atomic_add; and the decorator of aggregate classes ([Note] Partition state in
#   codegen/params.py), which 3.6 and 3.7 have only as triton.language.core._aggregate (the name
#   their own Gluon examples import), becomes public as gluon.aggregate.
# Each release's kernels ran on a GPU (kernels/hopper/common.py GLUON_TRITON_VERSIONS, the runtime guard) and
# compile offline for sm_90 in the CPU tests (GLUON_COMPILES_ON).
_GLUON_API = (
    ((3, 6), dict(tma_load="tma.async_copy_global_to_shared", tma_store="tma.async_copy_shared_to_global",
                  thread_barrier="gl.thread_barrier", tma_reduce_add="tma_reduce_add",
                  aggregate="triton.language.core._aggregate")),
    ((3, 7), dict(thread_barrier="gl.barrier")),
    ((3, 8), dict(tma_load="tma.async_load", tma_store="tma.async_store", tma_reduce_add="tma.async_atomic_add",
                  aggregate="gluon.aggregate")),
)


def gluon_api(version: Optional[str] = None) -> dict:
    """The Gluon spellings of the installed Triton (or of ``version``): see [Note] Gluon API by
    Triton release."""
    if version is None:
        try:
            import triton
        except ImportError:  # rendering for reading only (no kernel can be built without Triton)
            return dict(_GLUON_API[0][1])
        version = triton.__version__
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    names = dict(_GLUON_API[0][1])
    for first, spellings in _GLUON_API:
        if release >= first:
            names.update(spellings)
    return names


def debug_enabled() -> bool:
    return os.environ.get("FLEXATTN_DEBUG", "0") not in ("", "0")


def cache_dir() -> Path:
    """Where generated kernels and tuned configurations live (``FLEXATTN_CACHE_DIR`` overrides)."""
    root = os.environ.get("FLEXATTN_CACHE_DIR")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "flexattn")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


# Each kernel family's template and the name of the kernel (or kernel prefix) it defines, and the
# prefix of its generated files (the Hopper kernels' names: see codegen/params.py).
FAMILIES = {
    "forward": ("forward.py.jinja", "flex_attention_forward", "fwd"),
    "backward": ("backward.py.jinja", "flex_attention_backward", "bwd"),
    "decode": ("decode.py.jinja", "flex_attention_decode", "dec"),
    "hopper_forward": ("hopper_forward.py.jinja", "flex_attention_forward_sm90", "hopper_fwd"),
    "hopper_backward": ("hopper_backward.py.jinja", "flex_attention_backward_sm90", "hopper_bwd"),
}


@dataclass(frozen=True)
class KernelSpec:
    """Everything a family's template needs; all other choices are Triton constexprs at launch.
    ``score_grad`` (a LoweredScoreGrad, backward only) is the score_mod's lowered gradient; the
    backward also takes the forward's lowered mods, to recompute the scores."""

    family: str  # a key of FAMILIES
    score_mod: Optional[LoweredMod]
    mask_mod: Optional[LoweredMod]
    score_name: str = "identity"
    mask_name: str = "none"
    score_grad: Optional[object] = None
    # The forward only: the kernel merges its rows into a running result (forward.py.jinja, [Note]
    # Merging into the running result) instead of writing fresh outputs. Off, the source is unchanged.
    merge_into_running: bool = False

    def readable_name(self) -> str:
        prefix = FAMILIES[self.family][2] + ("_merge" if self.merge_into_running else "")
        return f"{prefix}_{_slug(self.score_name)}_{_slug(self.mask_name)}"


def _slug(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_")[:40] or "mod"


class Counts:
    """Renders and index hits in this process (tests check that a warm process renders nothing)."""

    renders = 0
    index_hits = 0


counts = Counts()


def render(spec: KernelSpec) -> str:
    """The kernel module's source: the family's template filled with plain values.

    Besides the lowered mods, a template gets the declarations of codegen/params.py: its kernels'
    parameters and its helpers' groups, and this render's groups of the mods' parameters."""
    counts.renders += 1
    template, kernel_name, _ = FAMILIES[spec.family]
    score_params = mods_group(spec.score_mod.kernel_params if spec.score_mod else ())
    mask_params = mods_group(spec.mask_mod.kernel_params if spec.mask_mod else ())
    # The backward's kernels hand the score_mod's gradient its parameters: the score_mod's (first),
    # then the gradient buffers of its trainable captured tensors.
    grad_params = mods_group(spec.score_grad.kernel_params if spec.score_grad else ())
    kernel_mods = grad_params if spec.family in ("backward", "hopper_backward") else score_params
    # The numbers the mods read are scalars the kernels are not specialised on (a new window size
    # reuses the compiled kernel): the kernels that take the mods list them in do_not_specialize.
    numbers = [p for m in (spec.score_mod, spec.mask_mod) if m is not None for p in m.number_params]
    source = _templates().get_template(template).render(
        do_not_specialize=lambda *names: _do_not_specialize(list(names) + numbers),
        kernel_name=kernel_name,
        description=f"score_mod={spec.score_name}, mask_mod={spec.mask_name}",
        score_mod=spec.score_mod,
        mask_mod=spec.mask_mod,
        score_grad=spec.score_grad,
        score_params=score_params,
        grad_params=grad_params,
        mask_params=mask_params,
        mods=mods_group(kernel_mods.names, mask_params.names),
        gluon_api=gluon_api(),
        merge_into_running=spec.merge_into_running,
        **TEMPLATE_GROUPS[spec.family],
    )
    # A group with no names (no mods) leaves a line of spaces where it stood; drop it.
    return _BLANK_GROUP_LINE.sub("", source)


def _do_not_specialize(names: list) -> str:
    """The decorator's argument list naming ``names`` (nothing when there are none)."""
    return "(do_not_specialize=[" + ", ".join(f'"{n}"' for n in names) + "])" if names else ""


_BLANK_GROUP_LINE = re.compile(r"^[ \t]+\n", re.M)


def _write_if_different(path: Path, text: str) -> None:
    # Leave an identical file alone, so its mtime (and anything keyed on it) stays put. Write to a
    # temporary name first so a concurrent process never imports half a file.
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# Content-keyed (the source's digest), bounded: an evicted module keeps working for whoever holds
# it, and comes back from its file if needed again. See [Note] Cache keys in kernels/family.py.
_loaded: "OrderedDict[str, ModuleType]" = OrderedDict()
_LOADED_KEPT = 256


def load_kernel_module(source: str, readable_name: str) -> ModuleType:
    """Write ``source`` under a content-addressed name and import it (once per process)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    stem = f"{readable_name}_{digest}"
    module = _loaded.get(stem)
    if module is not None:
        return module
    path = cache_dir() / "kernels" / f"{stem}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_if_different(path, source)
    if debug_enabled():
        print(f"[flexattn] kernel {stem}: {path}", file=sys.stderr)
    module_name = f"flexattn_generated_{stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _loaded[stem] = module
    if len(_loaded) > _LOADED_KEPT:
        evicted, _ = _loaded.popitem(last=False)
        sys.modules.pop(f"flexattn_generated_{evicted}", None)
    return module


# [Note] The kernel index. Lowering a mod and rendering its kernels costs a new process most of its
# first call's host time with warm disk caches: a score_mod's gradient is traced through torch's
# derivative formulas (make_fx, about 2 s for ALiBi on the first backward), sympy simplifies the
# index arithmetic, Jinja parses the templates. The kernel index keeps, on disk beside the kernels,
# which source file a family renders for a given input, so a later process imports that file
# without lowering or rendering again. The key is everything the rendered source depends on:
# the family, the traced mods' content (graph text, captured inputs' specs, frozen constants, the
# numbers' expressions, the specialized values, names), the lowering variants, the tanh option, the
# Triton release (the Gluon spellings follow it), and a digest of the package's code (every .py and
# .jinja file of flexattn, read once per process: the families' spec builders in kernels/ decide
# what is rendered as much as the templates and the lowering do, so any edit renders again). What it
# leaves out, and why that is safe: the shapes and values of a call (a source is the same for every
# call of its variants; launches choose constexprs, kept in the autotune store), and the lowering
# table's user entries (register_lowering): a process that registered one does not use the index.
# An entry names its source by the source's own digest, and the file is checked against it before
# it is imported, so a stale or damaged entry costs a render, never a wrong kernel.


def _code_digest() -> str:
    root = Path(__file__).parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".jinja"):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    try:
        import triton

        h.update(triton.__version__.encode())
    except ImportError:
        pass
    return h.hexdigest()[:16]


class KernelIndex:
    """Family input key -> ``{"stem", "source_digest", "readable_name", "trainable"}``, one small JSON
    file per entry under ``<cache dir>/index`` (see [Note] The kernel index)."""

    def __init__(self):
        self._digest: Optional[str] = None

    def key(self, parts: tuple) -> str:
        if self._digest is None:
            self._digest = _code_digest()
        return hashlib.sha256(repr((self._digest, parts)).encode()).hexdigest()[:32]

    def _path(self, key: str) -> Path:
        return cache_dir() / "index" / f"{key}.json"

    def get(self, key: str) -> Optional[tuple]:
        """``(record, source)`` for ``key``, or None (no entry, or a file that no longer matches)."""
        try:
            record = json.loads(self._path(key).read_text())
            source = (cache_dir() / "kernels" / f"{record['stem']}.py").read_text()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if hashlib.sha256(source.encode()).hexdigest()[:16] != record.get("source_digest"):
            return None
        counts.index_hits += 1
        return record, source

    def put(self, key: str, record: dict) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_if_different(path, json.dumps(record, sort_keys=True))
        except OSError:  # a read-only cache: the next process renders again
            pass


kernel_index = KernelIndex()
