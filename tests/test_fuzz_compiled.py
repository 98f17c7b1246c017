"""Differential fuzzer for the compiled path: mods that read Python numbers, whose values change.

Each case is one seed. From it the fuzzer picks a mod (a score_mod, or a mask_mod on a BlockMask),
how the mod reads a number (a closure, a global, a default argument, an object's attribute, a dict
item, a list item, a tuple, a tensor's size, an ``nn.Module``'s method, a ``functools.partial``, a
``mod_factory`` call in the compiled function), what it does with it (a comparison, index
arithmetic with ``//`` and ``%``, a scale, a soft-cap, a fill value, a Python branch), a number type
(int, float, bool) where the use allows it, a ``torch.compile`` mode (default, ``dynamic=True``,
``fullgraph=True``) and a sequence of values, repeats included. Every call runs compiled, eagerly,
and in float64 (``reference_attention``), and must agree; the number of Dynamo compiles stays
within what docs/compile.md's table says for that kind of number.

A bounded, seeded slice runs in the suite (about a minute on 2 cores). By hand::

    FLEXATTN_FUZZ_LONG=1 python -m pytest -q tests/test_fuzz_compiled.py        # 200 cases
    FLEXATTN_FUZZ_SEED=17 FLEXATTN_FUZZ_CASES=1 python -m pytest -q tests/test_fuzz_compiled.py

A failure prints the case.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing
from numerics import rel_err

import flexattn
from flexattn import create_block_mask, flex_attention
from flexattn.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LONG = os.environ.get("FLEXATTN_FUZZ_LONG", "0") not in ("", "0")
NUM_CASES = int(os.environ.get("FLEXATTN_FUZZ_CASES", "200" if LONG else "14"))
BASE_SEED = int(os.environ.get("FLEXATTN_FUZZ_SEED", "0"))
L = 96 if DEVICE == "cpu" else 256
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16

# Where the number lives, and what docs/compile.md says recompiles for it: "symbolic" (once at the
# second value, never with dynamic=True: ints only), "per value" (Dynamo guards or specialises it).
SOURCES = {
    "closure": "symbolic", "attribute": "symbolic", "dict item": "symbolic", "list item": "symbolic",
    "tuple": "symbolic", "tensor size": "symbolic", "default": "per value", "global": "per value",
    "module method": "per value", "partial": "per value", "mod_factory": "per value",
}
USES = {
    # name: (kind, types it takes, body(score or None, q_idx, kv_idx, n) -> value)
    "window": ("mask_mod", (int,), lambda s, q, kv, n: (q - kv <= n) & (q >= kv)),
    "prefix": ("mask_mod", (int,), lambda s, q, kv, n: (kv < n) | (q >= kv)),
    "chunks": ("mask_mod", (int,), lambda s, q, kv, n: q // n == kv // n),
    "stride": ("mask_mod", (int,), lambda s, q, kv, n: ((q - kv) % n == 0) | (q == kv)),
    "scale": ("score_mod", (int, float), lambda s, q, kv, n: s * n * 0.25),
    "softcap": ("score_mod", (float,), lambda s, q, kv, n: torch.tanh(s / n) * n),
    "fill": ("score_mod", (int, float), lambda s, q, kv, n: torch.where(q >= kv, s, n * 0.5 - s)),
    "flag": ("score_mod", (bool,), lambda s, q, kv, n: torch.where(q >= kv, s, s * n)),
    "offset": ("score_mod", (int,), lambda s, q, kv, n: s + ((q - kv + n) % 7).to(s.dtype) * 0.1),
    "branch": ("score_mod", (int,), lambda s, q, kv, n: s * 2 if n > 10 else s - (q - kv).to(s.dtype) * 0.01),
}
MODES = {"default": {}, "dynamic": {"dynamic": True}, "fullgraph": {"fullgraph": True}}


@dataclass
class Case:
    seed: int
    use: str
    source: str
    kind: type
    mode: str
    values: list

    def __str__(self):
        return (f"seed {self.seed}: {self.use} reading a {self.kind.__name__} through {self.source}, "
                f"mode {self.mode}, values {self.values}")


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    use = rng.choice(sorted(USES))
    kind = rng.choice(USES[use][1])
    source = rng.choice(sorted(SOURCES if kind is int else set(SOURCES) - {"tensor size"}))
    if kind is int:
        values = [rng.randint(2, 48) for _ in range(3)]
    elif kind is float:
        values = [round(rng.uniform(0.5, 30.0), 3) for _ in range(3)]
    else:
        values = [rng.random() < 0.5 for _ in range(3)]
    values.append(values[0])  # a value seen before comes back
    return Case(seed, use, source, kind, rng.choice(sorted(MODES)), values)


# -- the mods, one way of reading the number per source ---------------------------------------------

GLOBAL_NUMBER = 0


def _global_reader(body, score_mod: bool):
    if score_mod:
        def mod(score, b, h, q_idx, kv_idx):
            return body(score, q_idx, kv_idx, GLOBAL_NUMBER)
    else:
        def mod(b, h, q_idx, kv_idx):
            return body(None, q_idx, kv_idx, GLOBAL_NUMBER)
    return mod


class _Holder:
    pass


class _Module(torch.nn.Module):
    def __init__(self, body, score_mod: bool):
        super().__init__()
        self.body, self.number, self.is_score = body, 0, score_mod

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return self.body(score, q_idx, kv_idx, self.number)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.body(None, q_idx, kv_idx, self.number)


@flexattn.mod_factory
def _factory(body, score_mod: bool, n):
    if score_mod:
        def mod(score, b, h, q_idx, kv_idx):
            return body(score, q_idx, kv_idx, n)
    else:
        def mod(b, h, q_idx, kv_idx):
            return body(None, q_idx, kv_idx, n)
    return mod


def _partial_score(score, b, h, q_idx, kv_idx, body=None, n=0):
    return body(score, q_idx, kv_idx, n)


def _partial_mask(b, h, q_idx, kv_idx, body=None, n=0):
    return body(None, q_idx, kv_idx, n)


def _closure_over(body, score_mod: bool, read):
    """A mod reading its number with ``read()``: a closure over whatever ``read`` closes over."""
    if score_mod:
        def mod(score, b, h, q_idx, kv_idx):
            return body(score, q_idx, kv_idx, read())
    else:
        def mod(b, h, q_idx, kv_idx):
            return body(None, q_idx, kv_idx, read())
    return mod


class Reader:
    """Makes, for each value, the mod of one case's source (new objects, or the same ones changed)."""

    def __init__(self, case: Case):
        self.case = case
        self.body = USES[case.use][2]
        self.score_mod = USES[case.use][0] == "score_mod"
        self.holder, self.module, self.table = _Holder(), _Module(self.body, self.score_mod), {"n": 0}
        self.items = [0]
        self.mod_in_place = None

    def mod(self, n):
        """The mod for value ``n``, outside the compiled function (None: made inside it)."""
        body, score, source = self.body, self.score_mod, self.case.source
        if source == "closure":
            return _closure_over(body, score, lambda: n)
        if source == "default":
            if score:
                def mod(score_, b, h, q_idx, kv_idx, n=n):
                    return body(score_, q_idx, kv_idx, n)
            else:
                def mod(b, h, q_idx, kv_idx, n=n):
                    return body(None, q_idx, kv_idx, n)
            return mod
        if source == "attribute":
            self.holder.n = n
            holder = self.holder
            self.mod_in_place = self.mod_in_place or _closure_over(body, score, lambda: holder.n)
            return self.mod_in_place
        if source == "dict item":
            self.table["n"] = n
            table = self.table
            self.mod_in_place = self.mod_in_place or _closure_over(body, score, lambda: table["n"])
            return self.mod_in_place
        if source == "list item":
            self.items[0] = n
            items = self.items
            self.mod_in_place = self.mod_in_place or _closure_over(body, score, lambda: items[0])
            return self.mod_in_place
        if source == "tuple":
            pair = (1, n)
            return _closure_over(body, score, lambda: pair[1])
        if source == "tensor size":
            t = torch.zeros(n)
            return _closure_over(body, score, lambda: t.shape[0])
        if source == "global":
            global GLOBAL_NUMBER
            GLOBAL_NUMBER = n
            self.mod_in_place = self.mod_in_place or _global_reader(body, score)
            return self.mod_in_place
        if source == "module method":
            self.module.number = n
            return self.module.score_mod if score else self.module.mask_mod
        return None  # partial, mod_factory: made inside the compiled function

    def made_inside(self, n):
        """The mod for value ``n`` as the compiled function makes it (a partial, a factory call)."""
        if self.case.source == "partial":
            return functools.partial(_partial_score if self.score_mod else _partial_mask, body=self.body, n=n)
        return _factory(self.body, self.score_mod, n)


def run_case(case: Case):
    reader = Reader(case)
    g = torch.Generator().manual_seed(case.seed)
    q, k, v = (torch.randn(1, 2, L, 16, generator=g).to(DEVICE, DTYPE) for _ in range(3))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager" if DEVICE == "cpu" else "inductor")
    inside = case.source in ("partial", "mod_factory")
    score_mod = reader.score_mod

    def attend(q, k, v, mod, n, block_mask):
        if inside:
            mod = reader.made_inside(n)
        if score_mod:
            return flex_attention(q, k, v, score_mod=mod)
        return flex_attention(q, k, v, block_mask=block_mask)

    compiled = torch.compile(attend, backend=counter, **MODES[case.mode])
    for n in case.values:
        mod = reader.mod(n) if not inside else None
        eager_mod = mod if mod is not None else reader.made_inside(n)
        block_mask = None if score_mod else create_block_mask(eager_mod, None, None, L, L, device=DEVICE)
        got = compiled(q, k, v, mod, n, block_mask)
        eager = flex_attention(q, k, v, score_mod=eager_mod) if score_mod else flex_attention(q, k, v, block_mask=block_mask)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        want = reference_attention(q64, k64, v64, score_mod=eager_mod if score_mod else None,
                                   mask_mod=None if score_mod else eager_mod)[0]
        if DTYPE == torch.float32:
            assert rel_err(got, want) < 2e-5, f"{case}: compiled off at {n}"
            assert rel_err(eager, want) < 2e-5, f"{case}: eager off at {n}"
        else:  # the flash-attention rule: at most about twice the error of eager at the same dtype
            assert rel_err(got, want) <= 2 * rel_err(eager, want) + 1e-3, f"{case}: compiled off at {n}"
    return counter.frame_count


def allowed_compiles(case: Case) -> int:
    distinct = len(set(case.values))
    if case.use == "branch":  # a Python branch: Dynamo guards the condition (one per outcome at most)
        return distinct
    if SOURCES[case.source] == "per value" or case.kind is not int:
        return distinct + 1  # floats: Dynamo's second compile tries a symbolic float first
    return 1 if case.mode == "dynamic" else 2


CASES = [make_case(BASE_SEED + i) for i in range(NUM_CASES)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiled_call_follows_every_value_of_a_number(case, one_thread):
    torch._dynamo.reset()
    try:
        compiles = run_case(case)
    finally:
        torch._dynamo.reset()
    assert compiles <= allowed_compiles(case), f"{case}: {compiles} compiles"


def test_the_slice_covers_every_source_use_and_mode():
    # The bounded slice is small; it still reaches every source and mode (the seeds are chosen so).
    if NUM_CASES < 14 or BASE_SEED != 0:
        pytest.skip("a replay or a custom run")
    assert {c.mode for c in CASES} == set(MODES)
    assert len({c.source for c in CASES}) >= 8 and len({c.use for c in CASES}) >= 7
