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
    "DECODE_PARTIAL", "DECODE_MERGE", "HOPPER_FORWARD", "HOPPER_BACKWARD_DKDV", "HOPPER_BACKWARD_DQ", "KERNELS",
    "FORWARD_HELPERS", "BACKWARD_HELPERS", "DECODE_HELPERS", "HOPPER_FORWARD_STATE", "HOPPER_BACKWARD_STATE",
    "TEMPLATE_GROUPS",
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

    @property
    def tail(self) -> str:
        """The names after a call's or a def's own arguments, on one line: ``, a, b`` (nothing when
        the group is empty). For the mods' hooks, whose groups hold no constexprs."""
        return "".join(f", {n}" for n in self.expanded())

    def tail_of(self, holder: str) -> str:
        """``tail`` read from the fields of ``holder``, an aggregate of the group: ``, m.a, m.b``."""
        return "".join(f", {holder}.{n}" for n in self.expanded())

    def wrapped(self, indent: int, width: int = 112) -> str:
        """The names for a call, comma-separated and wrapped at ``width`` columns, the lines after the
        first indented by ``indent`` spaces (for an aggregate's constructor in a Gluon template)."""
        lines, line = [], ""
        for n in self.expanded():
            if line and indent + len(line) + len(n) + 2 > width:
                lines.append(line + ",")
                line = ""
            line = f"{line}, {n}" if line else n
        return ("\n" + " " * indent).join(lines + [line]) if line else ""

    @property
    def aggregate(self) -> str:
        """The name of the group's aggregate class in a Gluon template: ``dkdv_ring`` -> ``DkdvRing``."""
        return "".join(part.title() for part in self.name.split("_"))

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

    def names(self, mods: Group = mods_group()) -> tuple:
        """The kernel's parameter names in signature order (``mods``: this render's)."""
        return tuple(n for g in self.groups for n in (mods if g.kind == "mods" else g).expanded())

    def argument_count(self, mods: int = 0) -> int:
        """How many runtime arguments a launch passes with ``mods`` mod arguments (none for a kernel
        that takes no mods, such as the backward's preprocess)."""
        takes_mods = any(g.kind == "mods" for g in self.runtime)
        return sum(len(g.expanded()) for g in self.runtime if g.kind != "mods") + (mods if takes_mods else 0)

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


# [Note] Launch order (kernels/launch_order.py): how many of the grid's last (batch, head) pairs
# interleave their programs, heaviest block first. Not specialised on (do_not_specialize): a new
# value never compiles a kernel again.
_LAUNCH_ORDER = _scalars("TAIL_PAIRS", doc="the grid's last (batch, head) pairs, whose programs interleave heaviest block first")

_MODS = mods_group()  # a placeholder: each render fills in its mods' parameters

# The BlockMask's geometry and the tiles of a launch, shared by the attention kernels.
_SPARSE_LAYOUT = _constexprs("SPARSE_Z", "SPARSE_HQ", "GQA_GROUP")
_HEAD_DIMS = _constexprs("QK_HEAD_DIM", "QK_HEAD_DIM_P2", "V_HEAD_DIM", "V_HEAD_DIM_P2")
_TILES = _constexprs("SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "EVEN_M", "EVEN_N")
_MOD_FLAGS = _constexprs("HAS_SCORE_MOD", "SCALE_FIRST", "HAS_PARTIAL_BLOCKS", "HAS_FULL_BLOCKS")


_FORWARD_QKV_STRIDES = _strides(q="zhmd", k="zhnd", v="zhnd")
_FORWARD_OUT_STRIDES = _strides(o="zhmd")

FORWARD = KernelParams("flex_attention_forward", [
    _tensors("Q", "K", "V", "OUT", "LSE", "MAX_SCORES"),
    _tensors("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX", doc="the BlockMask's forward tables"),
    _FORWARD_QKV_STRIDES,
    _FORWARD_OUT_STRIDES,
    _scalars("SPARSE_ROWS", "IDX_COLS", "FULL_IDX_COLS", doc="the tables' rows and widths"),
    _scalars("Q_LEN", "KV_LEN", "SM_SCALE"),
    _LAUNCH_ORDER,
    _MODS,
    _SPARSE_LAYOUT,
    _HEAD_DIMS,
    _TILES,
    _MOD_FLAGS,
    _constexprs("CONSECUTIVE_PARTIAL", "CONSECUTIVE_FULL", "OUTPUT_LSE", "OUTPUT_MAX"),
    _constexprs("INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS", "KV_AS_FLOAT16"),
    _constexprs("USE_TMA", "HOST_DESCRIPTORS", "WARP_SPECIALIZE"),
], doc="one program per BLOCK_M queries of one query head")

BACKWARD_PREPROCESS = KernelParams("flex_attention_backward_preprocess", [
    _tensors("OUT", "DO", "DLSE", "DELTA"),
    _strides(o="zhmd", do="zhmd"),
    _scalars("Q_LEN"),
    _constexprs("V_HEAD_DIM", "V_HEAD_DIM_P2", "BLOCK_M", "HAS_DLSE"),
], doc="DELTA = rowsum(DO * O) - dLSE")

_BACKWARD_FLAGS = _constexprs("INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS", "USE_TMA", "DETERMINISTIC")

BACKWARD_DKDV = KernelParams("flex_attention_backward_dkdv", [
    _tensors("Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV"),
    _tensors("Q_NUM_BLKS", "Q_IDX", "FULL_Q_NUM_BLKS", "FULL_Q_IDX", doc="the transposed tables"),
    _strides(q="zhmd", k="zhnd", v="zhnd", do="zhmd"),
    _strides(dk="zhnd", dv="zhnd"),
    _tensors("GRAD_TURNS", doc="DETERMINISTIC: each gradient slot's finished programs (int32)"),
    _scalars("GRAD_SLOTS", "GRAD_SLOT_STRIDE", doc="DETERMINISTIC: the slots of each gradient buffer, their stride"),
    _scalars("SPARSE_COLS", "IDX_ROWS", "FULL_IDX_ROWS"),
    _scalars("Q_LEN", "KV_LEN", "SM_SCALE"),
    _LAUNCH_ORDER,
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
    _LAUNCH_ORDER,
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
    _constexprs("OUTPUT_LSE", "INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS", "KV_AS_FLOAT16"),
], doc="one program per split of one group of query rows")

DECODE_MERGE = KernelParams("flex_attention_decode_merge", [
    _tensors("OUT", "LSE", "ACC_SCRATCH", "M_SCRATCH", "L_SCRATCH"),
    _strides(o="zhmd"),
    _DECODE_ROWS,
    _constexprs("NUM_SPLITS_P2", "SPLIT_CHUNK", "V_HEAD_DIM", "V_HEAD_DIM_P2", "BLOCK_M", "MERGE_M", "MERGE_D",
                "D_CHUNKS", "OUTPUT_LSE"),
], doc="combines the splits of the partial kernel")

_RESIDENT_IN_REGISTERS = _constexprs(
    "RESIDENT_IN_REGISTERS",
    doc="each consumer holds the tile it keeps for its whole walk (forward: Q; dK/dV: K and V) in registers, as "
        "its S (and dP) products' first operand ([Note] Resident tiles in registers, kernels/hopper/common.py)")

# The Hopper kernels' names end in _sm90, the compute capability, as profilers have shown them: traces,
# the recorded data in docs/data and the launch records that compare two versions key on them.
HOPPER_FORWARD = KernelParams("flex_attention_forward_sm90", [
    _tensors("Q", "K", "V", "OUT", doc="2-D tensor descriptors over each tensor's storage ([Note] 2-D views)"),
    _tensors("LSE"),
    _tensors("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX", doc="the BlockMask's forward tables"),
    _tensors("WALK_NUM", "WALK", doc="UNION_WALK: each program's walk across two query blocks (kernels/tables.py "
                                     "ProgramWalks); otherwise stand-ins, not read"),
    _scalars("WALK_ROWS", "WALK_COLS", doc="the walks' rows (programs) and width"),
    _scalars("row_qz", "row_qh", "col_qh", "row_kz", "row_kh", "col_kh", "row_vz", "row_vh", "col_vh",
             "row_oz", "row_oh", "col_oh",
             doc="where a (batch, head)'s rows start in each descriptor: rows per batch and head, columns per head"),
    _scalars("SPARSE_ROWS", "IDX_COLS", "FULL_IDX_COLS", doc="the tables' rows and widths"),
    _scalars("Q_LEN", "SM_SCALE"),
    _LAUNCH_ORDER,
    _MODS,
    _SPARSE_LAYOUT,
    _constexprs("HEAD_DIM", "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "STAGES",
                "CONSUMER_REGS"),
    _MOD_FLAGS,
    _constexprs("OUTPUT_LSE"),
    _RESIDENT_IN_REGISTERS,
    _constexprs("CONSUMERS", doc="consumer warpgroups of 64 query rows: 2 (BLOCK_M 128, the BlockMask's query block), "
                                 "or 3 (BLOCK_M 192) on a walk every row shares ([Note] Three consumers on an unmasked "
                                 "walk, kernels/hopper/forward.py)"),
    _constexprs("TAKE_TURNS", doc="the consumers issue their products in a fixed round ([Note] Turns on the tensor "
                                  "cores, kernels/hopper/forward.py)"),
    _constexprs("UNION_WALK", doc="three consumers whose program spans two query blocks walk the union of their walks "
                                  "([Note] Programs across query blocks, kernels/hopper/forward.py)"),
], doc="Hopper, Gluon: one program per 128 (or 192) queries of one query head, a loader warp and two (or three) "
       "consumer warpgroups")

_HOPPER_TILES = _constexprs("HEAD_DIM", "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "STAGES",
                          "CONSUMER_REGS")

HOPPER_BACKWARD_DKDV = KernelParams("flex_attention_backward_dkdv_sm90", [
    _tensors("Q", "K", "V", "DO", "DK", "DV", doc="2-D tensor descriptors over each tensor's storage"),
    _tensors("DQ_ACC", doc="FUSED_DQ: a float32 [batch * query heads * Q_LEN, HEAD_DIM] descriptor the kernel adds dQ "
                           "into, in boxes of 64 rows and hopper.backward.DQ_BOX_COLUMNS columns"),
    _tensors("LSE", "DELTA"),
    _tensors("Q_NUM_BLKS", "Q_IDX", "FULL_Q_NUM_BLKS", "FULL_Q_IDX", doc="the transposed tables"),
    _tensors("WALK_FIRST", "Q_TURNS", "FULL_Q_TURNS", "DQ_ADDED",
             doc="ORDERED_DQ: each column's first walk entry and each table entry's turn (tables.DqTurns), and a "
                 "zeroed int32 count of the parts added so far per 64-row query tile and 64 columns of dQ"),
    _scalars("row_qz", "row_qh", "col_qh", "row_kz", "row_kh", "col_kh", "row_vz", "row_vh", "col_vh",
             "row_doz", "row_doh", "col_doh", "row_dkz", "row_dkh", "col_dkh",
             doc="where a (batch, head)'s rows start in each descriptor (DK and DV share one layout)"),
    _scalars("SPARSE_COLS", "IDX_ROWS", "FULL_IDX_ROWS"),
    _scalars("Q_LEN", "SM_SCALE"),
    _LAUNCH_ORDER,
    _MODS,
    _SPARSE_LAYOUT,
    _HOPPER_TILES,
    _MOD_FLAGS,
    _constexprs("FUSED_DQ", doc="dQ added into DQ_ACC by the copy engine here, so no dQ kernel runs"),
    _constexprs("ORDERED_DQ", doc="with FUSED_DQ: each query tile's parts added in key block order, bit-identical "
                                  "from run to run (a deterministic call)"),
    _RESIDENT_IN_REGISTERS,
], doc="Hopper, Gluon: one program per 128 keys of one key/value head, a loader warp and two consumer warpgroups")

HOPPER_BACKWARD_DQ = KernelParams("flex_attention_backward_dq_sm90", [
    _tensors("Q", "K", "V", "DO", "DQ", doc="2-D tensor descriptors over each tensor's storage"),
    _tensors("LSE", "DELTA"),
    _tensors("KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX", doc="the BlockMask's forward tables"),
    _scalars("row_qz", "row_qh", "col_qh", "row_kz", "row_kh", "col_kh", "row_vz", "row_vh", "col_vh",
             "row_doz", "row_doh", "col_doh", doc="where a (batch, head)'s rows start in each descriptor"),
    _scalars("SPARSE_ROWS", "IDX_COLS", "FULL_IDX_COLS"),
    _scalars("Q_LEN", "SM_SCALE"),
    _LAUNCH_ORDER,
    _MODS,
    _SPARSE_LAYOUT,
    _HOPPER_TILES,
    _MOD_FLAGS,
], doc="Hopper, Gluon: one program per 128 queries of one query head, a loader warp and two consumer warpgroups")

KERNELS = {
    "forward": (FORWARD,),
    "backward": (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ),
    "decode": (DECODE_PARTIAL, DECODE_MERGE),
    "hopper_forward": (HOPPER_FORWARD,),
    "hopper_backward": (BACKWARD_PREPROCESS, HOPPER_BACKWARD_DKDV, HOPPER_BACKWARD_DQ),
}


# ---- What a kernel hands its inner helpers ----------------------------------------------------------
# Triton inlines the helpers, so the order of their parameters is free and costs nothing (unlike the
# kernels' above, which the launchers fill positionally). A helper's def and each call of it list the
# same groups, one a line: runtime groups and its own values first, then constexpr groups and its own
# constexprs, which a call passes by name (keyword arguments come after the positional ones).


def _values(name: str, *names: str, doc: str = "") -> Group:
    return Group(name, names, doc=doc)


def _flags(name: str, *names: str, doc: str = "") -> Group:
    return Group(name, names, kind="constexprs", doc=doc)


def _by_name(*groups: Group) -> dict:
    named = {g.name: g for g in groups}
    if len(named) != len(groups):
        raise ValueError("two helper groups of one template share a name")
    return named


_HELPER_HEAD_DIMS = _flags("head_dims", *_HEAD_DIMS.names)
_HELPER_MOD_FLAGS = _flags("mod_flags", "HAS_SCORE_MOD", "SCALE_FIRST",
                           doc="whether a score_mod runs, and whether the scale is applied before it")
# A program owns a block of rows (queries in the forward, the decode and dQ; keys in dK/dV) and walks
# tiles of the other side's rows.
_SOFTMAX = _values("softmax", "acc", "l_i", "m_i", doc="the online softmax's running output, row sum and row max")
_QUERY_BLOCK = _values("query_block", "q", "off_z", "off_hq", "q_idx", "SM_SCALE",
                       doc="this program's query tile, what the mods see of it (batch, head, positions), the scale")
_KEY_TILES = _flags("key_tiles", "SPARSE_KV_BLOCK_SIZE", "BLOCK_N", "EVEN_N",
                    doc="a sparse block's keys, walked BLOCK_N at a time; EVEN_N: no tile crosses KV_LEN")

FORWARD_HELPERS = _by_name(
    _SOFTMAX,
    _QUERY_BLOCK,
    _values("key_rows", "k_src", "v_src", "kv_z", "off_hkv", "offs_d", "offs_dv",
            "stride_kn", "stride_kd", "stride_vn", "stride_vd", "KV_LEN",
            doc="where the key and value tiles are read: pointers or descriptors, and how"),
    _HELPER_HEAD_DIMS,
    _KEY_TILES,
    _HELPER_MOD_FLAGS,
    _flags("loads", "INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS", "USE_TMA", "HOST_DESCRIPTORS",
           doc="how tiles are loaded and multiplied"),
    # The helpers of each load mode ([Note] Load modes in the template).
    _values("q_strides", *(n for n in _FORWARD_QKV_STRIDES.expanded() if n.startswith("stride_q")), doc="Q's strides"),
    _values("kv_strides", *(n for n in _FORWARD_QKV_STRIDES.expanded() if not n.startswith("stride_q")),
            doc="K's and V's strides"),
    _values("out_strides", *_FORWARD_OUT_STRIDES.expanded(), doc="OUT's strides"),
)

BACKWARD_HELPERS = _by_name(
    # dK/dV: a program owns a block of keys and walks the query rows that see them.
    _values("grads", "dk", "dv", doc="the program's running dK (not yet scaled) and dV"),
    _values("key_block", "k", "v", "off_z", "kv_idx", "offs_n", "KV_LEN", "SM_SCALE",
            doc="this program's key and value tiles, what the mods see of them, the scale"),
    _values("query_rows", "off_hq", "q_src", "do_src", "offs_d", "offs_dv",
            "stride_qm", "stride_qd", "stride_dom", "stride_dod", "Q_LEN",
            doc="the query head walked: where its Q and dO tiles are read"),
    _flags("query_tiles", "SPARSE_Q_BLOCK_SIZE", "BLOCK_M", "EVEN_M", "EVEN_N",
           doc="a sparse block's queries, walked BLOCK_M at a time; EVEN_*: no tile crosses a length"),
    # dQ: a program owns a block of queries and walks the key rows they see.
    _values("query_block", "q", "do", "lse", "delta", "off_z", "off_hq", "q_idx", "offs_m", "Q_LEN", "SM_SCALE",
            doc="this program's query rows (Q, dO, LSE, DELTA), what the mods see of them, the scale"),
    _values("key_rows", "k_src", "v_src", "offs_d", "offs_dv", "stride_kn", "stride_kd", "stride_vn", "stride_vd",
            "KV_LEN", doc="where the key and value tiles are read"),
    _flags("key_tiles", "SPARSE_KV_BLOCK_SIZE", "BLOCK_N", "EVEN_M", "EVEN_N",
           doc="a sparse block's keys, walked BLOCK_N at a time; EVEN_*: no tile crosses a length"),
    _HELPER_HEAD_DIMS,
    _HELPER_MOD_FLAGS,
    _flags("loads", "INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS", "USE_TMA", "DETERMINISTIC"),
)

DECODE_HELPERS = _by_name(
    _SOFTMAX,
    _QUERY_BLOCK,  # the packed rows of [Note] Decode tiles: off_hq and q_idx are columns
    _values("key_rows", "k_base", "v_base", "offs_d", "offs_dv", "stride_kn", "stride_kd", "stride_vn", "stride_vd",
            "KV_LEN", doc="where the key and value tiles are read"),
    _HELPER_HEAD_DIMS,
    _KEY_TILES,
    _HELPER_MOD_FLAGS,
    _flags("loads", "INPUT_PRECISION", "NUM_STAGES", "UPCAST_DOTS"),
    # store_rows: where finished rows go
    _values("outputs", "OUT", "LSE", "stride_oz", "stride_oh", "stride_om", "stride_od"),
    _values("packed_rows", "off_z", "heads", "queries", "row_ok",
            doc="each packed row's batch, head and query, and whether it is a real row"),
    _flags("output_dims", "NUM_HEADS_Q", "QUERY_LEN", "V_HEAD_DIM", doc="OUT's heads, queries and head dim"),
)

# [Note] Partition state. What the Hopper kernels' partitions share, in groups: each group is an
# aggregate class of the rendered module (templates/hopper_state.py.jinja, state_class), which the
# kernel fills and gl.warp_specialize hands to every partition, so a partition takes one argument per
# group and reads a value as ``ring.k_ready``. Constexprs stay constexprs in them, and the mods'
# tensors are one more aggregate (Mods), made from each render's mods group.
HOPPER_FORWARD_STATE = _by_name(
    _values("ring", "q_bufs", "k_smem", "v_smem", "q_bar", "k_ready", "v_ready", "k_empty", "v_empty", "turns",
            doc="the shared-memory buffers and the mbarriers of the Q buffers and the K/V ring, and the "
                "consumers' turns"),
    _values("views", "Q", "K", "V", "OUT", "LSE", "row_qz", "row_qh", "col_qh", "row_kz", "row_kh", "col_kh",
            "row_vz", "row_vh", "col_vh", "row_oz", "row_oh", "col_oh",
            doc="the descriptors and where a (batch, head) starts in them"),
    _values("program", "off_z", "off_hq", "off_hkv", "start_m", "num_partial", "num_full", "partial_idx", "full_idx",
            doc="the program's batch, heads and query block, and its row of the block tables"),
    _values("mod_flags", "SM_SCALE", "HAS_SCORE_MOD", "SCALE_FIRST", "HAS_PARTIAL_BLOCKS", "UNION_WALK",
            "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE",
            doc="the scale, which mods run, whether the walk is a union of two query blocks' walks, and the "
                "block sizes (the mods' kv_idx is counted in key blocks)"),
    _values("shape", "Q_LEN", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "STAGES", "OUTPUT_LSE", "RESIDENT_IN_REGISTERS",
            "CONSUMERS", "TAKE_TURNS",
            doc="the query length, the tiles, the ring's depth, whether the LSE is written, where Q is held, how "
                "many consumer warpgroups, whether they take turns"),
)

# The Hopper backward's partition state, one set of groups per kernel ([Note] Partition state).
_HOPPER_VIEWS = ("row_qz", "row_qh", "col_qh", "row_kz", "row_kh", "col_kh", "row_vz", "row_vh", "col_vh",
                 "row_doz", "row_doh", "col_doh")
HOPPER_BACKWARD_STATE = _by_name(
    _values("dkdv_ring", "q_smem", "do_smem", "k_smem", "v_smem", "lse_smem", "delta_smem", "ds_smem", "dq_smem",
            "ds_ready", "ds_free", "dq_full", "dq_empty", "kv_bar", "ready", "empty",
            doc="dK/dV: the key tiles, the query-side ring (Q, dO, LSE, DELTA per slot) and its mbarriers; "
                "with FUSED_DQ each consumer's dS^T and dQ tiles"),
    _values("dkdv_views", "Q", "K", "V", "DO", "DK", "DV", "DQ_ACC", "DQ_ADDED", "LSE", "DELTA", *_HOPPER_VIEWS,
            "row_dkz", "row_dkh", "col_dkh",
            doc="dK/dV: the descriptors and where a (batch, head) starts in them"),
    _values("dkdv_program", "off_z", "off_hkv", "start_n", "Q_NUM_BLKS", "Q_IDX", "FULL_Q_NUM_BLKS", "FULL_Q_IDX",
            "WALK_FIRST", "Q_TURNS", "FULL_Q_TURNS", "SPARSE_COLS", "IDX_ROWS", "FULL_IDX_ROWS",
            doc="dK/dV: the program's batch, head and key block, and the transposed tables"),
    _values("dkdv_flags", "SM_SCALE", "Q_LEN", "HAS_SCORE_MOD", "SCALE_FIRST", "HAS_PARTIAL_BLOCKS",
            "HAS_FULL_BLOCKS", "SPARSE_Z", "SPARSE_HQ", "GQA_GROUP", "SPARSE_Q_BLOCK_SIZE", "BLOCK_M", "BLOCK_N",
            "HEAD_DIM", "STAGES", "FUSED_DQ", "ORDERED_DQ", "RESIDENT_IN_REGISTERS",
            doc="dK/dV: the scale, the query length, which mods run, the tiles"),
    _values("dq_ring", "q_bufs", "do_bufs", "k_smem", "v_smem", "q_bar", "k_ready", "v_ready", "k_empty", "v_empty",
            doc="dQ: the Q and dO buffers, the K/V ring and their mbarriers"),
    _values("dq_views", "Q", "K", "V", "DO", "DQ", "LSE", "DELTA", *_HOPPER_VIEWS,
            doc="dQ: the descriptors and where a (batch, head) starts in them"),
    _values("dq_program", "off_z", "off_hq", "off_hkv", "start_m", "num_partial", "num_full", "partial_idx", "full_idx",
            doc="dQ: the program's batch, heads and query block, and its row of the block tables"),
    _values("dq_flags", "SM_SCALE", "Q_LEN", "HAS_SCORE_MOD", "SCALE_FIRST", "HAS_PARTIAL_BLOCKS",
            "SPARSE_KV_BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "HEAD_DIM", "STAGES",
            doc="dQ: the scale, the query length, which mods run, the tiles"),
)

# What codegen.render hands each family's template besides the mods: its kernels' declarations, by
# their names above, and its helpers' groups.
TEMPLATE_GROUPS = {
    "forward": dict(FORWARD=FORWARD, **FORWARD_HELPERS),
    "backward": dict(BACKWARD_PREPROCESS=BACKWARD_PREPROCESS, BACKWARD_DKDV=BACKWARD_DKDV, BACKWARD_DQ=BACKWARD_DQ,
                     **BACKWARD_HELPERS),
    "decode": dict(DECODE_PARTIAL=DECODE_PARTIAL, DECODE_MERGE=DECODE_MERGE, **DECODE_HELPERS),
    "hopper_forward": dict(HOPPER_FORWARD=HOPPER_FORWARD, **HOPPER_FORWARD_STATE),
    "hopper_backward": dict(BACKWARD_PREPROCESS=BACKWARD_PREPROCESS, HOPPER_BACKWARD_DKDV=HOPPER_BACKWARD_DKDV,
                          HOPPER_BACKWARD_DQ=HOPPER_BACKWARD_DQ, **HOPPER_BACKWARD_STATE),
}
