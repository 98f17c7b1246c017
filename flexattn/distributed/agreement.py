"""Ranks agreeing on what they are about to compute: one fixed-size all_gather per check, and the
same error on every rank, naming what differs and which ranks, when they do not.

[Note] Agreement
Context parallelism is right only if every rank computes with the same mask, mods, captured
tensors, numbers the mods read, and options; and it finishes only if every rank posts the
transfers the others expect. Both depend on what each rank was given, so before anything whose
participation could diverge, the ranks compare what they were given:

1. Each rank states its *facts* inside ``with Agreement(...) as check:``: values (shapes, dtypes,
   flags, the schedule), digests of texts (a traced graph), and contents (captured tensors, by a
   digest of their bytes; a Python number by its value and type).
2. On leaving the block, every rank all-gathers one record of three int64s: whether its block
   raised, a hash of its values and texts (blake2b, host-side), and a hash of its contents
   (computed on the tensors' device, no host sync until the record is read). Equal records: done.
3. Otherwise every rank knows it, so every rank takes part in a second, rarer round
   (all_gather_object of each rank's facts, or of its error) and raises the same
   :class:`~flexattn.errors.RankDisagreementError` built from the same gathered data. Ranks that
   all failed with one error re-raise it, unchanged: that is no disagreement.

Nothing is skipped on later calls: a record hashes this call's facts, so "the same callable, the
same code, the same shapes, other contents" differs where it must. A rank whose own checks raise
still takes part in step 2, so its peers raise too instead of waiting for it.

The contents digest reads the tensor's bytes (row-major, zero-padded) as 32-bit words, in chunks
of 2**20: per chunk, the sum modulo 2**64 of splitmix64's finaliser of ``position << 32 | word``
(the position within the chunk), then that sum mixed with the chunk's index, and the chunks'
results summed. It does not depend on the device, the strides or the order of the sums, and any
single changed word changes it (the finaliser is a bijection). It leaves out nothing of the bytes:
-0.0 and 0.0 (or two NaN payloads) differ, as they may give different results.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import RankDisagreementError

__all__ = ["Agreement", "entries_digest", "record_device", "tensor_digest"]

# 32-bit words hashed per chunk: bounds the temporaries (two int64 tensors of this size, and the
# positions table).
_WORD_CHUNK = 1 << 20
# splitmix64's multipliers as signed int64 (torch's int64 products wrap modulo 2**64).
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _as_int64(n: int) -> int:
    """``n`` modulo 2**64, as a signed int64."""
    return (n + (1 << 63)) % (1 << 64) - (1 << 63)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise and in place on int64 ``x`` (a bijection of 64-bit words
    that spreads every input bit over the output). Shifts are logical: torch's ``>>`` is
    arithmetic, so the bits it copies from the sign are masked off. In place: half the time."""
    shifted = torch.empty_like(x)
    for bits, multiplier in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, bits, out=shifted)
        shifted &= (1 << (64 - bits)) - 1
        x ^= shifted
        if multiplier is not None:
            x *= multiplier
    return x


def entries_digest(keys: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 digest of the multiset of int64 ``keys`` (any order), on their device."""
    return _mix_(keys.reshape(-1).to(torch.int64, copy=True)).sum()


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as 32-bit words (uint32), zero-padded to a whole word."""
    raw = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)
    pad = -raw.numel() % 4
    if pad or raw.storage_offset() % 4:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.uint32)


# ``position << 32`` of one chunk's words, per device: a constant table (its key, the device,
# leaves out nothing it depends on).
_POSITIONS: dict = {}


def _chunk_positions(device: torch.device) -> torch.Tensor:
    positions = _POSITIONS.get(device)
    if positions is None or positions.numel() < _WORD_CHUNK:
        positions = _POSITIONS[device] = torch.arange(_WORD_CHUNK, dtype=torch.int64, device=device) << 32
    return positions


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 digest of ``t``'s contents on ``t``'s device (see [Note] Agreement). Its dtype
    and shape are not in it: callers state them as values."""
    words = _words(t)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    positions = _chunk_positions(t.device)
    for index, start in enumerate(range(0, words.numel(), _WORD_CHUNK)):
        chunk = words[start:start + _WORD_CHUNK].to(torch.int64)
        chunk |= positions[: chunk.numel()]
        # Each chunk's sum is mixed once more with the chunk's index: chunks cannot trade places.
        total += _mix_(_mix_(chunk).sum().view(1) + _as_int64(index * _GOLDEN))[0]
    return total


def record_device(group) -> torch.device:
    """Where the group's collectives take their tensors: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _canonical(value):
    """A hashable, exact form of a value: floats by their hex form (so -0.0 and 0.0 differ)."""
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(v) for v in value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"Agreement: a value must be a bool, int, float, str, None or a tuple of them, "
                    f"got {type(value).__name__}")


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _groups(values: list) -> list:
    """Ranks grouped by equal value, in order of their first rank: [(value, [ranks])]."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), (value, []))[1].append(rank)
    return list(groups.values())


class Agreement:
    """A context manager: the facts stated in its block must be the same on every rank of ``group``.

    ::

        with Agreement(group, "the call", "Every rank must ...") as check:
            ...                                   # this rank's own checks; may raise
            check.value("batch", B)
            check.digest("score_mod's traced graph", code)
            check.contents("the score_mod's captured tensor 'slopes'", slopes)

    Leaving the block runs the check ([Note] Agreement), whether the block raised or not. ``what``
    names what the facts describe; ``fix`` says what the caller should do about a difference.
    """

    def __init__(self, group, what: str, fix: str) -> None:
        self.group, self.what, self.fix = group, what, fix
        self.device = record_device(group)
        self._values: dict = {}  # name -> (canonical, shown text)
        self._digests: dict = {}  # name -> hex digest
        self._contents: list = []  # (name, 0-d int64 digest on the record's device)
        self.agreed: Optional[str] = None  # after a check that passed: the record's hashes, as text

    def value(self, name: str, value) -> None:
        """A value every rank must have, shown in the error."""
        self._values[name] = (_canonical(value), repr(value))

    def digest(self, name: str, data) -> None:
        """A text, bytes or int every rank must have, compared by a hash (the error says which
        ranks have which, not the data)."""
        if isinstance(data, str):
            data = data.encode()
        elif isinstance(data, int):
            data = str(data).encode()
        self._digests[name] = hashlib.blake2b(data, digest_size=8).hexdigest()

    def contents(self, name: str, value) -> None:
        """A captured input every rank must hold: a tensor (its dtype and shape as a value, its
        bytes as a digest computed on its device), or a Python number (its type and value)."""
        if isinstance(value, torch.Tensor):
            self.value(f"the dtype and shape of {name}", (str(value.dtype), tuple(value.shape)))
            self._contents.append((name, tensor_digest(value).to(self.device)))
        elif isinstance(value, (bool, int, float)):
            self.value(name, (type(value).__name__, value))
        else:
            raise TypeError(f"Agreement: {name} is a {type(value).__name__}, not a tensor or a Python number")

    # ------------------------------------------------------------------------------ the check

    def __enter__(self) -> "Agreement":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and not issubclass(exc_type, Exception):
            return False  # an interrupt: no collective
        world = dist.get_world_size(self.group)
        record = torch.tensor([exc is not None, self._host_hash(), 0], dtype=torch.int64, device=self.device)
        if exc is None and self._contents:
            record[2] = self._contents_hash()
        gathered = [torch.empty_like(record) for _ in range(world)]
        dist.all_gather(gathered, record, group=self.group)
        table = torch.stack(gathered).cpu().tolist()
        if all(row == table[0] for row in table) and not table[0][0]:
            self.agreed = f"{table[0][1]:x}:{table[0][2]:x}"
            return False
        facts = [None] * world
        dist.all_gather_object(facts, self._facts(exc), group=self.group)
        errors = [f["error"] for f in facts]
        if exc is not None and all(e == errors[0] for e in errors):
            return False  # every rank failed alike: its own error, the same everywhere
        message = self._message(facts, world)
        if exc is not None:
            raise RankDisagreementError(message) from exc
        raise RankDisagreementError(message)

    def _host_hash(self) -> int:
        text = repr(([(k, v[0]) for k, v in self._values.items()], sorted(self._digests.items())))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)

    def _contents_hash(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.int64, device=self.device)
        for digest in (d for _, d in self._contents):  # in order: a reordering differs
            total = _mix_((total + digest).view(1))[0]
        return total

    def _facts(self, exc: Optional[BaseException]) -> dict:
        """What the second round gathers: the error, or every fact in a form the message shows."""
        if exc is not None:
            return {"error": f"{type(exc).__name__}: {exc}", "facts": {}}
        facts = {name: ("value", canonical, shown) for name, (canonical, shown) in self._values.items()}
        facts.update((name, ("digest", d, None)) for name, d in self._digests.items())
        if self._contents:
            digests = torch.stack([d for _, d in self._contents]).cpu().tolist()
            facts.update((f"the contents of {name}", ("digest", d, None))
                         for (name, _), d in zip(self._contents, digests))
        return {"error": None, "facts": facts}

    def _message(self, gathered: list, world: int) -> str:
        """The error, from the gathered facts only: the same text on every rank."""
        head = f"ContextParallel: the {world} ranks disagree on {self.what}: "
        failed = [r for r, g in enumerate(gathered) if g["error"] is not None]
        if failed:
            fine = [r for r in range(world) if r not in failed]
            parts = [f"{_ranks(ranks)} raised {error}" for error, ranks in _groups([g["error"] for g in gathered])
                     if error is not None]
            return head + "; ".join(parts) + (f" ({_ranks(fine)} did not)" if fine else "") + f". {self.fix}"
        parts = []
        for name in dict.fromkeys(name for g in gathered for name in g["facts"]):
            entries = [g["facts"].get(name) for g in gathered]
            groups = _groups([None if e is None else e[:2] for e in entries])
            if len(groups) == 1:
                continue
            firsts = [entries[ranks[0]] for _, ranks in groups]
            if any(e is None or e[0] == "value" for e in firsts):
                shown = "; ".join(f"{_ranks(ranks)}: {'absent' if e is None else e[2] or 'given'}"
                                  for e, (_, ranks) in zip(firsts, groups))
            else:  # digests: which ranks hold the same, not the digests themselves
                shown = ", ".join(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} one" if i == 0
                                  else f"{_ranks(ranks)} another" for i, (_, ranks) in enumerate(groups))
            parts.append(f"{name} ({shown})")
        if not parts:  # the records differed, the facts do not: a tensor changed between the two rounds
            parts.append("their facts changed between the two rounds of the check")
        return head + "; ".join(parts) + f". {self.fix}"
