"""The cost model of a context-parallel call: time per rank for the ring and for the gather of the
needed shards, from tile counts, shard sizes and a few machine numbers.

It serves two purposes: ``schedule="auto"`` picks the faster schedule with it (the plan knows every
rank's tile counts, so every rank makes the same choice), and ``python -m
benchmarks.context_parallel --model`` predicts throughput at sizes no test machine holds,
beside torch's all-gather design on the same numbers (docs/context_parallel.md lists the
assumptions).

Per rank, in the ring: the first step is the rank's own K/V shard; the next shard is received
while the current one is computed (one step ahead), so a step lasts ``max(compute, transfer of the
next)``, plus a fixed ``step_latency_s`` (a kernel launch, a p2p round, the merge's launches). In
the gather: every needed shard is received at once (one transfer of all their bytes), then one
kernel runs over all of them, with no merge. The slowest rank sets the time of the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

__all__ = ["CostModel", "Problem", "StepCost", "ring_seconds", "gather_seconds", "allgather_kv_seconds",
           "BACKWARD_COMPUTE"]

# The backward's work per tile against the forward's: five matmuls of the tile's size against two
# (FlashAttention-2's count).
BACKWARD_COMPUTE = 2.5


@dataclass(frozen=True)
class CostModel:
    """The machine, as the cost model sees it.

    Args:
        flops_per_s: forward throughput of the attention kernel on full tiles (FLOP/s, counting
            ``4 * Q_BLOCK * KV_BLOCK * head_dim`` per tile).
        link_bytes_per_s: bytes per second one rank receives (and, at the same time, sends).
        step_latency_s: fixed time of one step: a kernel launch, one p2p round, the merge's launches.
        memory_bytes_per_s: device memory bandwidth (the merge and the gather's concatenation).
        partial_tile_cost: time of a partial tile (mask_mod evaluated) over a full one.
        gather_limit_bytes: the most K/V bytes the gather schedule may hold on one rank (short
            sequences); beyond it the ring runs, whose memory stays at two shards in flight.
    """

    flops_per_s: float
    link_bytes_per_s: float
    step_latency_s: float
    memory_bytes_per_s: float
    partial_tile_cost: float = 1.3
    gather_limit_bytes: int = 256 << 20

    @classmethod
    def for_device(cls, device: torch.device) -> "CostModel":
        """Defaults: for CUDA devices, a Hopper GPU over NVLink 4 (the forward's causal d=128
        throughput, rounded down: docs/benchmarks.md, "Forward"), a small CPU over loopback gloo
        otherwise."""
        if torch.device(device).type == "cuda":
            return cls(flops_per_s=450e12, link_bytes_per_s=450e9, step_latency_s=30e-6, memory_bytes_per_s=3.0e12)
        return cls(flops_per_s=20e9, link_bytes_per_s=2e9, step_latency_s=300e-6, memory_bytes_per_s=10e9)


class Problem(NamedTuple):
    """The sizes of one call that set its cost (the lengths come from the plan)."""

    batch: int
    q_heads: int
    kv_batch: int
    kv_heads: int
    head_dim: int
    value_dim: int
    itemsize: int

    def tile_flops(self, block_size: tuple[int, int]) -> float:
        q_block, kv_block = block_size
        return 2.0 * q_block * kv_block * (self.head_dim + self.value_dim) * self.batch * self.q_heads

    def shard_bytes(self, kv_length: int) -> int:
        """K and V of one shard of ``kv_length`` tokens."""
        return self.kv_batch * self.kv_heads * kv_length * (self.head_dim + self.value_dim) * self.itemsize

    def transfer_factor(self, backward: bool) -> float:
        """Bytes moved per byte of a K/V shard: the forward receives it; the backward receives it
        again and returns its dK/dV, which travel in float32."""
        return 1.0 + (max(4, self.itemsize) / self.itemsize if backward else 0.0)

    def output_bytes(self, q_length: int) -> int:
        """The float32 output accumulator of one shard of ``q_length`` queries, with its LSE."""
        return self.batch * self.q_heads * q_length * (self.value_dim + 1) * 4


class StepCost(NamedTuple):
    """One step of a rank: its tiles, and whether its shard must be received first."""

    full: int
    partial: int
    received: bool


def _compute_seconds(model: CostModel, problem: Problem, block_size, full: int, partial: int) -> float:
    tiles = full + model.partial_tile_cost * partial
    return tiles * problem.tile_flops(block_size) / model.flops_per_s


def ring_seconds(model: CostModel, problem: Problem, block_size, q_length: int, kv_length: int,
                 steps: Sequence[StepCost], backward: bool = False) -> float:
    """One rank's time in the ring, its steps in order (the own shard first, if it has tiles).

    The transfer of step k+1 overlaps the compute of step k. In the backward every step also
    sends the shard's dK/dV back, and receives one for the rank's own shard: twice the bytes in
    each direction, and ``BACKWARD_COMPUTE`` times the work.
    """
    work = BACKWARD_COMPUTE if backward else 1.0
    transfer = problem.transfer_factor(backward) * problem.shard_bytes(kv_length) / model.link_bytes_per_s
    merge = 3 * problem.output_bytes(q_length) / model.memory_bytes_per_s
    total = 0.0
    if steps and steps[0].received:
        total += transfer  # nothing to compute while the first shard arrives
    for k, step in enumerate(steps):
        compute = work * _compute_seconds(model, problem, block_size, step.full, step.partial)
        upcoming = transfer if k + 1 < len(steps) and steps[k + 1].received else 0.0
        total += max(compute, upcoming) + model.step_latency_s + (merge if k and not backward else 0.0)
    return total


def gather_seconds(model: CostModel, problem: Problem, block_size, kv_length: int, full: int, partial: int,
                   received: int, backward: bool = False) -> float:
    """One rank's time when it receives its ``received`` needed shards at once, concatenates them
    with its own and runs one kernel (the backward sends the dK/dV of each back the same way)."""
    shard = problem.shard_bytes(kv_length)
    transfers = problem.transfer_factor(backward) * received * shard / model.link_bytes_per_s
    copy = 2 * (received + 1) * shard / model.memory_bytes_per_s
    work = BACKWARD_COMPUTE if backward else 1.0
    compute = work * _compute_seconds(model, problem, block_size, full, partial)
    return transfers + copy + compute + 2 * model.step_latency_s


def allgather_kv_seconds(model: CostModel, problem: Problem, block_size, kv_length: int, world: int, full: int,
                         partial: int, backward: bool = False) -> float:
    """One rank's time in torch's design (``context_parallel`` for flex_attention): K and V of the
    whole sequence all-gathered before the kernel (no skipping, no overlap with it), then the
    rank's queries against them; the backward reduce-scatters dK/dV the same way, with the
    gathered K/V kept from the forward."""
    transfer = (world - 1) * problem.shard_bytes(kv_length) / model.link_bytes_per_s
    work = BACKWARD_COMPUTE if backward else 1.0
    compute = work * _compute_seconds(model, problem, block_size, full, partial)
    return transfer + compute + 2 * model.step_latency_s
