"""The model of one rank's memory under context parallelism, and the number of head chunks it picks.

[Note] A rank's memory
A rank holds, like one GPU does for the whole sequence, its own tensors: q, k, v, the output's
gradient, the output and LSE autograd keeps, and dq, dk, dv (``held_bytes``). Context parallelism
adds *working* buffers, which one GPU does not have (``working_bytes``, the backward's, which are
the larger): received K/V shards, the float32 dK/dV sum of the own shard and the parts in flight
to and from the owners, each step's dQ part, and a float32 dQ sum where a rank has more than two
steps (ring.py, _GradSum). All of them are per head, so running the schedule one chunk of heads at
a time divides them by the number of chunks ([Note] Head chunks in ring.py). The counts are what
the code allocates, checked against the live tensor bytes of gloo ranks
(tests/test_cp_memory.py); docs/context_parallel.md ("Memory") has the table and the numbers.

``"auto"`` takes the fewest chunks (a divisor of the key/value heads, so each chunk keeps whole
groups of GQA) whose working buffers fit in a quarter of the held bytes, or in ``SMALL_BYTES``
where that is more: below it the extra launches of chunks cost more than the memory is worth.
Every input is agreed between ranks (shapes, dtype, world size, schedule), so every rank picks the
same count, as the exchanges need.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["RankShapes", "held_bytes", "working_bytes", "choose_head_chunks", "SMALL_BYTES", "WORKING_SHARE"]

SMALL_BYTES = 256 << 20  # working buffers under this are left whole (one chunk)
WORKING_SHARE = 0.25  # "auto": working buffers at most this share of the held bytes


class RankShapes(NamedTuple):
    """One rank's call: batch, heads, shard lengths, head dims and the element size of its dtype."""

    batch: int
    q_heads: int
    kv_batch: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    itemsize: int

    @property
    def working_itemsize(self) -> int:
        """Sums and parts in float32, float64 for float64 (reference.working_dtype)."""
        return 8 if self.itemsize == 8 else 4

    def q_head(self, dim: int, itemsize: int) -> int:
        """Bytes of one query head's rows of width ``dim``."""
        return self.batch * self.q_len * dim * itemsize

    def kv_head(self, itemsize: int) -> int:
        """Bytes of one key/value head's K and V."""
        return self.kv_batch * self.kv_len * (self.head_dim + self.value_dim) * itemsize


def held_bytes(s: RankShapes) -> int:
    """q, k, v, the output's gradient, out, lse, dq, dk, dv: what one GPU holds too, for 1/R of the tokens."""
    q, out = s.q_head(s.head_dim, s.itemsize), s.q_head(s.value_dim, s.itemsize)
    row = s.q_head(1, s.working_itemsize)
    return s.q_heads * (2 * q + 2 * out + row) + s.kv_heads * 2 * s.kv_head(s.itemsize)


def working_bytes(s: RankShapes, world: int, schedule: str, chunks: int = 1) -> dict:
    """The backward's working buffers at their peak, by name, for a chunk of ``1/chunks`` of the
    heads, at the most a rank of ``world`` can need (every shard: R steps, R - 1 rounds)."""
    hq, hk = s.q_heads // chunks, s.kv_heads // chunks
    w, kv, kv_w = s.working_itemsize, s.kv_head(s.itemsize), s.kv_head(s.working_itemsize)
    peers = world - 1
    own_sum = {"dK/dV sum of the own shard (float32)": hk * kv_w}
    dq_sum = {"dQ sum (float32)": hq * s.q_head(s.head_dim, w) if world > 2 and w != s.itemsize else 0}
    if schedule == "allgather":  # every needed shard, their concatenation, dK/dV of all of it
        received, parts, arriving = (2 * peers + 1) * hk * kv if peers else 0, world * hk * kv_w, 0
    else:  # the shard in the kernel and the one arriving; the previous round's exchange in flight
        received, parts, arriving = min(2, peers) * hk * kv, hk * kv_w, 2 * hk * kv_w if peers >= 2 else 0
    step = {  # a step's kernels have just returned
        "received K/V": received, **own_sum, "dK/dV parts of the step (float32)": parts,
        "dK/dV parts in flight (float32)": arriving, "dQ part of the step": hq * s.q_head(s.head_dim, s.itemsize),
        **dq_sum, "delta": hq * s.q_head(1, w),
    }
    # The last exchange: the shards are dropped, the parts are sent and the own shard's arrive
    # (every peer's at once in the gather).
    exchange = {**own_sum, "dK/dV parts of the step (float32)": parts,
                "dK/dV parts in flight (float32)": max(1, peers if schedule == "allgather" else 1) * hk * kv_w,
                **dq_sum}
    return max(step, exchange, key=lambda buffers: sum(buffers.values()))


def choose_head_chunks(s: RankShapes, world: int, schedule: str) -> int:
    """The fewest chunks (a divisor of the key/value heads) whose working buffers fit the budget
    of [Note] A rank's memory; all of the heads' divisors' largest where none does."""
    budget = max(SMALL_BYTES, WORKING_SHARE * held_bytes(s))
    divisors = [c for c in range(1, s.kv_heads + 1) if s.kv_heads % c == 0]
    for chunks in divisors:
        if sum(working_bytes(s, world, schedule, chunks).values()) <= budget:
            return chunks
    return divisors[-1]
