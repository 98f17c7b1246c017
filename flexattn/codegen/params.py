"""Each kernel's parameters, declared once.

A kernel's signature in its template, the argument tuple its launcher passes, and the groups of
values its inner helpers take are all generated from the declarations below, so they cannot drift
apart. The launcher builds its arguments with ``FORWARD.pack(Q=q, ..., mods=[...])``: a name it
forgets or misspells is a TypeError naming it, raised before Triton runs; the constexprs of a plan
are checked against the declaration once per plan (``check_constexprs``).

A :class:`Group` is a few names that travel together. In a template, ``{{ g.params }}`` lists them
for a ``def`` (constexprs with ``: tl.constexpr``) and ``{{ g.args }}`` for a call (constexprs by
name, ``BLOCK_N=BLOCK_N``); both end with a comma, so groups line up and an empty one vanishes.
The mods' parameters (their captured tensors and strides) are known only when a kernel is
rendered: the ``mods`` group is built then (:func:`mods_group`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = [
    "Group", "KernelParams", "mods_group", "FORWARD", "BACKWARD_PREPROCESS", "BACKWARD_DKDV", "BACKWARD_DQ",
    "DECODE_PARTIAL", "DECODE_MERGE", "KERNELS",
]


class Group(NamedTuple):
    """Names that travel together.

    ``kind`` says what the launcher passes for them: "tensors" (one tensor each), "strides" (each
    name is a tensor's short name; with its axes in ``axes`` it expands to ``stride_qz``,
    ``stride_qh``, ..., and the launcher passes the tensor's strides as one tuple,
    ``stride_q=q.stride()``), "scalars"
    (ints and floats), "mods" (the mods' captured tensors and strides, one list), "constexprs"
    (compile-time values, passed by name), or "values" (what a kernel hands its helpers)."""

    name: str
    names: tuple
    kind: str = "values"
    axes: tuple = ()  # "strides" only: each tensor's axis letters, e.g. "zhmd" for a query-side tensor
    doc: str = ""

    @property
    def constexpr(self) -> bool:
        return self.kind == "constexprs"

    def expanded(self) -> tuple:
        """The parameter names, strides expanded."""
        if self.kind == "strides":
            return tuple(f"stride_{t}{axis}" for t, axes in zip(self.names, self.axes) for axis in axes)
        return tuple(self.names)

    @property
    def params(self) -> str:
        """The names for a ``def``, each followed by a comma."""
        suffix = ": tl.constexpr" if self.constexpr else ""
        return "".join(f"{n}{suffix}, " for n in self.expanded()).rstrip(" ")

    @property
    def args(self) -> str:
        """The names for a call, each followed by a comma; constexprs passed by name."""
        if self.constexpr:
            return "".join(f"{n}={n}, " for n in self.expanded()).rstrip(" ")
        return "".join(f"{n}, " for n in self.expanded()).rstrip(" ")

    def __str__(self) -> str:
        return self.args


def mods_group(*param_lists: Sequence[str]) -> Group:
    """The mods' extra parameters of one rendered kernel (LoweredMod.kernel_params, in order)."""
    return Group("mods", tuple(p for params in param_lists for p in params), kind="mods")


class KernelParams:
    """The parameters of one kernel, in signature order: runtime groups, then constexpr groups."""

    def __init__(self, name: str, groups: Sequence[Group], doc: str = ""):
        self.name = name
        self.groups = tuple(groups)
        self.doc = doc
        seen: set = set()
        for g in self.groups:
            for n in g.expanded():
                if n in seen:
                    raise ValueError(f"{name}: parameter {n} is declared twice")
                seen.add(n)
        self.runtime = tuple(g for g in self.groups if not g.constexpr)
        self.constexpr_names = frozenset(n for g in self.groups if g.constexpr for n in g.names)
        self.pack = self._packer()

    def signature(self, mods: Group = mods_group(), indent: str = "    ") -> str:
        """The kernel's parameter list for its ``def``, one group a line (``mods``: this render's)."""
        lines = [(mods if g.kind == "mods" else g).params for g in self.groups]
        return "\n".join(indent + line for line in lines if line)

    def argument_count(self, mods: int = 0) -> int:
        """How many runtime arguments a launch passes with ``mods`` mod arguments."""
        return sum(len(g.expanded()) for g in self.runtime if g.kind != "mods") + mods

    def _packer(self):
        """``pack(**values) -> tuple``: the runtime arguments in signature order. Generated once per
        kernel as plain Python (keyword-only parameters, one tuple display), so a warm launch pays no
        more than a hand-written tuple and a wrong or missing name is a TypeError."""
        keywords, items = [], []
        for g in self.runtime:
            if g.kind == "strides":
                for t in g.names:
                    keywords.append(f"stride_{t}")
                    items.append(f"*stride_{t}")
            elif g.kind == "mods":
                keywords.append("mods")
                items.append("*mods")
            else:
                keywords.extend(g.names)
                items.extend(g.names)
        source = f"def pack(*, {', '.join(keywords)}):\n    return ({', '.join(items)},)\n"
        namespace: dict = {}
        exec(compile(source, f"<flexattn pack {self.name}>", "exec"), namespace)  # noqa: S102 - our own source
        pack = namespace["pack"]
        pack.__doc__ = f"The runtime arguments of {self.name}, in its signature's order."
        return pack

    def check_constexprs(self, constexprs: dict) -> None:
        """A plan's constexprs must name exactly the declared ones (plus the launch options)."""
        given = set(constexprs) - {"num_warps", "num_stages"}
        if given != self.constexpr_names:
            missing, extra = sorted(self.constexpr_names - given), sorted(given - self.constexpr_names)
            raise TypeError(f"{self.name}: constexprs missing {missing}, not declared {extra}")

    def __repr__(self) -> str:
        return f"KernelParams({self.name!r})"


def _strides(doc: str = "", **axes: str) -> Group:
    """Strides of tensors along their axes, e.g. ``q="zhmd"``: batch, head, row (m for queries, n
    for keys) and head dim."""
    return Group("strides", tuple(axes), kind="strides", axes=tuple(axes.values()), doc=doc)


def _tensors(*names: str, doc: str = "") -> Group:
    return Group("tensors", names, kind="tensors", doc=doc)


def _scalars(*names: str, doc: str = "") -> Group:
    return Group("scalars", names, kind="scalars", doc=doc)


def _constexprs(*names: str, doc: str = "") -> Group:
    return Group("constexprs", names, kind="constexprs", doc=doc)


_MODS = mods_group()  # a placeholder: each render fills in its mods' parameters

# The BlockMask's geometry and the tiles of a launch, shared by the attention kernels.
_SPARSE_LAYOUT = _constexprs("SPARSE_Z", "SPARSE_HQ", "GQA_GROUP")
_HEAD_DIMS = _constexprs("QK_HEAD_DIM", "QK_HEAD_DIM_P2", "V_HEAD_DIM", "V_HEAD_DIM_P2")
_TILES = _constexprs("SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "EVEN_M", "EVEN_N")
_MOD_FLAGS = _constexprs("HAS_SCORE_MOD", "SCALE_FIRST", "HAS_PARTIAL_BLOCKS", "HAS_FULL_BLOCKS")


FORWARD = KernelParams("flex_attention_forward", [
    _tensors("Q", "K", "V", "OUT", "LSE", "MAX_SCORES"),
    _tensors("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX", doc="the BlockMask's forward tables"),
    _strides(q="zhmd", k="zhnd", v="zhnd"),
    _strides(o="zhmd"),
    _scalars("SPARSE_ROWS", "IDX_COLS", "FULL_IDX_COLS", doc="the tables' rows and widths"),
    _scalars("Q_LEN", "KV_LEN", "SM_SCALE"),
    _MODS,
    _SPARSE_LAYOUT,
    _HEAD_DIMS,
    _TILES,
    _MOD_FLAGS,
    _constexprs("CONSECUTIVE_PARTIAL", "CONSECUTIVE_FULL", "OUTPUT_LSE", "OUTPUT_MAX"),
    _constexprs("INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS"),
    _constexprs("USE_TMA", "HOST_DESCRIPTORS", "WARP_SPECIALIZE"),
], doc="one program per BLOCK_M queries of one query head")

BACKWARD_PREPROCESS = KernelParams("flex_attention_backward_preprocess", [
    _tensors("OUT", "DO", "DLSE", "DELTA"),
    _strides(o="zhmd", do="zhmd"),
    _scalars("Q_LEN"),
    _constexprs("V_HEAD_DIM", "V_HEAD_DIM_P2", "BLOCK_M", "HAS_DLSE"),
], doc="DELTA = rowsum(DO * O) - dLSE")

_BACKWARD_FLAGS = _constexprs("INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS", "USE_TMA")

BACKWARD_DKDV = KernelParams("flex_attention_backward_dkdv", [
    _tensors("Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV"),
    _tensors("Q_NUM_BLKS", "Q_IDX", "FULL_Q_NUM_BLKS", "FULL_Q_IDX", doc="the transposed tables"),
    _strides(q="zhmd", k="zhnd", v="zhnd", do="zhmd"),
    _strides(dk="zhnd", dv="zhnd"),
    _scalars("SPARSE_COLS", "IDX_ROWS", "FULL_IDX_ROWS"),
    _scalars("Q_LEN", "KV_LEN", "SM_SCALE"),
    _MODS,
    _SPARSE_LAYOUT,
    _HEAD_DIMS,
    _TILES,
    _MOD_FLAGS,
    _BACKWARD_FLAGS,
], doc="one program per BLOCK_N keys of one key/value head")

BACKWARD_DQ = KernelParams("flex_attention_backward_dq", [
    _tensors("Q", "K", "V", "DO", "LSE", "DELTA", "DQ"),
    _tensors("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX"),
    _strides(q="zhmd", k="zhnd", v="zhnd", do="zhmd"),
    _strides(dq="zhmd"),
    _scalars("SPARSE_ROWS", "IDX_COLS", "FULL_IDX_COLS"),
    _scalars("Q_LEN", "KV_LEN", "SM_SCALE"),
    _MODS,
    _SPARSE_LAYOUT,
    _HEAD_DIMS,
    _TILES,
    _MOD_FLAGS,
    _BACKWARD_FLAGS,
], doc="one program per BLOCK_M queries of one query head")

_DECODE_ROWS = _constexprs("NUM_HEADS_Q", "QUERY_LEN", "HEADS", "ROW_TILES", "NUM_SPLITS")

DECODE_PARTIAL = KernelParams("flex_attention_decode_partial", [
    _tensors("Q", "K", "V", "OUT", "LSE", "ACC_SCRATCH", "M_SCRATCH", "L_SCRATCH"),
    _tensors("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX"),
    _strides(q="zhmd", k="zhnd", v="zhnd"),
    _strides(o="zhmd"),
    _scalars("SPARSE_ROWS", "IDX_COLS", "FULL_IDX_COLS", "KV_LEN", "SM_SCALE"),
    _MODS,
    _DECODE_ROWS,
    _SPARSE_LAYOUT,
    _HEAD_DIMS,
    _constexprs("SPARSE_KV_BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "EVEN_N"),
    _MOD_FLAGS,
    _constexprs("OUTPUT_LSE", "INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS"),
], doc="one program per split of one group of query rows")

DECODE_MERGE = KernelParams("flex_attention_decode_merge", [
    _tensors("OUT", "LSE", "ACC_SCRATCH", "M_SCRATCH", "L_SCRATCH"),
    _strides(o="zhmd"),
    _DECODE_ROWS,
    _constexprs("NUM_SPLITS_P2", "SPLIT_CHUNK", "V_HEAD_DIM", "V_HEAD_DIM_P2", "BLOCK_M", "MERGE_M", "MERGE_D",
                "D_CHUNKS", "OUTPUT_LSE"),
], doc="combines the splits of the partial kernel")

KERNELS = {
    "forward": (FORWARD,),
    "backward": (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ),
    "decode": (DECODE_PARTIAL, DECODE_MERGE),
}
