"""Running one rank's plan: the forward and backward loops over its rounds and steps, and the
autograd Function that ties them together.

Ring forward, per rank: post round 1 (the first shard on its way), compute the own shard, then for
each round s: post round s+1, wait for round s, compute the shard it brought, merge. Received
shards alternate between two buffers, so a rank holds its own shard and at most two others. A
round's ops run on NCCL's stream after the work already queued (so a buffer is overwritten only
after the kernel that read it), and the wait makes the kernel wait for the transfer, not the host.

Ring backward: the same rounds bring the K/V shards again; after each step the rank sends the
step's dK/dV to the shard's owner and receives the dK/dV of its own shard from the rank it sent
it to in that round (the same pairs, reversed), one exchange in flight at a time. dK/dV travel in
float32 (each part unrounded) and every gradient's parts are summed before one rounding
(_GradSum). Gradients of the score_mod's learnable tensors are this rank's share (see
ContextParallel.flex_attention).

The gather schedule runs the same pieces with one round that brings every needed shard, one
kernel over their concatenation, and one round that returns every dK/dV.

[Note] Head chunks
The query-sized buffers of the ring (the forward's float32 merge, the dQ parts and sums, the
received shards and the dK/dV parts in flight) are per head. A RankRun of several HeadChunks runs
the whole schedule for the first chunk's heads, writes that chunk's slice of the results, then
runs the next: those buffers shrink by the number of chunks, for as many more rounds and launches
(docs/context_parallel.md, "Memory"; memory.py chooses the count).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from ..kernels.launch import output_layout
from .comm import Exchange
from .plan import RankPlan
from .step import StepCall, merge_into, working_dtype

__all__ = ["HeadChunk", "RankRun", "ContextParallelFunction"]


def _wait(works: Optional[list]) -> None:
    for work in works or ():
        work.wait()


class HeadChunk(NamedTuple):
    """The heads one pass of the schedule runs ([Note] Head chunks): query heads ``q_heads`` and
    key/value heads ``kv_heads`` (slices of dim 1), and a StepCall per step of the rank's plan."""

    q_heads: slice
    kv_heads: slice
    step_calls: list


class _Merged:
    """The running (out, lse, max_scores) of a chunk's steps, written into the call's results.

    [Note] The merge in the kernel. A step after the first merges into the running result in its
    own kernel's epilogue where that kernel can (the portable Triton forward: [Note] Merging into
    the running result in templates/forward.py.jinja), which saves a pass of torch ops over the
    float32 output per step. Elsewhere (the PyTorch backend, the decode kernels, the Hopper Gluon
    forward) the step returns its result and ``merge_into`` folds it in. Either way the result is
    the same merge, and the backward reads only the merged statistics."""

    def __init__(self, need_max: bool) -> None:
        self.need_max = need_max
        self.out = self.lse = self.max = None

    def run(self, sc: StepCall, q, k, v) -> None:
        """Run step ``sc`` of queries ``q`` against keys ``k``, ``v`` and fold its result in."""
        if self.out is not None and sc.forward_into(q, k, v, (self.out, self.lse, self.max)):
            return
        self.add(*sc.forward(q, k, v, self.need_max))

    def add(self, out: torch.Tensor, lse: torch.Tensor, max_scores: Optional[torch.Tensor]) -> None:
        if self.out is None:  # the step's own fresh outputs become the accumulators
            self.out, self.lse, self.max = out.to(working_dtype(out.dtype)), lse, max_scores
            return
        merge_into(self.out, self.lse, out, lse)
        if self.need_max:
            torch.maximum(self.max, max_scores, out=self.max)

    def write(self, out: torch.Tensor, lse: torch.Tensor, max_scores: Optional[torch.Tensor]) -> None:
        """Into the results' slices; a chunk whose queries keep no key gives zeros and an LSE of -inf."""
        if self.out is None:
            out.zero_()
            lse.fill_(-float("inf"))
            if max_scores is not None:
                max_scores.fill_(-float("inf"))
            return
        out.copy_(self.out)
        lse.copy_(self.lse)
        if max_scores is not None:
            max_scores.copy_(self.max)


class _GradSum:
    """The sum of a gradient's parts into ``dest``, a slice of the result (in the inputs' dtype),
    rounded once. The parts add in ``dest`` itself where that loses nothing: ``dest`` in the
    working precision, or at most two parts that come in ``dest``'s dtype (the sum of two rounds
    once either way: the same bits). Else they add in a working-precision buffer, which is the
    first part itself when that part is in the working precision already (a fresh kernel output
    or receive buffer: nothing else holds it)."""

    def __init__(self, dest: torch.Tensor, parts: int) -> None:
        self.dest, self.parts = dest, parts
        self.acc, self.count, self.in_place = None, 0, False

    def add(self, part: torch.Tensor) -> None:
        working = working_dtype(self.dest.dtype)
        if self.count == 0:
            self.in_place = part.dtype == self.dest.dtype and (self.dest.dtype == working or self.parts <= 2)
            if self.in_place:
                self.dest.copy_(part)
            else:
                self.acc = part if part.dtype == working else part.to(working)
        elif self.in_place:
            self.dest.add_(part)
        else:
            self.acc.add_(part)
        self.count += 1

    def finish(self) -> None:
        if self.count == 0:
            self.dest.zero_()
        elif self.acc is not None:
            self.dest.copy_(self.acc)
            self.acc = None


class RankRun:
    """One call on one rank: its plan for the call's schedule, its head chunks (each with a
    StepCall per step), and the exchange. ``learnable``: the score_mod's captured tensors that take
    a gradient."""

    def __init__(self, plan: RankPlan, chunks: list, exchange: Exchange, need_max: bool, learnable: list) -> None:
        self.plan, self.chunks, self.exchange = plan, chunks, exchange
        self.need_max, self.learnable = need_max, learnable

    # ------------------------------------------------------------------------------ exchanges

    def _post_kv(self, index: int, k, v, slots: list) -> list:
        """Start ring round ``index``: the own shard to whoever needs it, the next needed shard into
        buffer ``index % 2``."""
        rnd = self.plan.rounds[index]
        sends = [(t, peer) for peer in rnd.send_to for t in (k, v)]
        recvs = []
        if rnd.recv_from:
            slot = index % 2
            if slots[slot] is None:
                slots[slot] = (torch.empty_like(k), torch.empty_like(v))
            recvs = [(t, rnd.recv_from[0]) for t in slots[slot]]
        return self.exchange.post(sends, recvs)

    def _gather_kv(self, k, v) -> dict:
        """The gather's round: every needed shard at once; returns {source: (k, v)}."""
        rnd = self.plan.rounds[0]
        received = {src: (torch.empty_like(k), torch.empty_like(v)) for src in rnd.recv_from}
        _wait(self.exchange.post([(t, peer) for peer in rnd.send_to for t in (k, v)],
                                 [(t, src) for src, pair in received.items() for t in pair]))
        return received

    def _keys_of(self, sc: StepCall, k, v, received: dict):
        parts = [(k, v) if src == self.plan.rank else received[src] for src in sc.step.sources]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)

    @staticmethod
    def _heads(chunk: HeadChunk, q, k, v):
        """The chunk's heads of q, k, v; k and v contiguous, as the exchange sends them."""
        return q[:, chunk.q_heads], k[:, chunk.kv_heads].contiguous(), v[:, chunk.kv_heads].contiguous()

    # ------------------------------------------------------------------------------ forward

    def forward(self, q, k, v):
        """``(out, lse, max_scores or None)`` of the rank's queries: each chunk's slice in turn."""
        B, Hq, L, _ = q.shape
        shape, dims = output_layout(q, v.shape[-1])
        out = torch.empty(shape, dtype=q.dtype, device=q.device).permute(dims)
        lse = torch.empty((B, Hq, L), dtype=working_dtype(q.dtype), device=q.device)
        max_scores = torch.empty_like(lse) if self.need_max else None
        for chunk in self.chunks:
            merged = self._chunk_forward(chunk, *self._heads(chunk, q, k, v))
            merged.write(out[:, chunk.q_heads], lse[:, chunk.q_heads],
                         None if max_scores is None else max_scores[:, chunk.q_heads])
        return out, lse, max_scores

    def _chunk_forward(self, chunk: HeadChunk, q, k, v) -> _Merged:
        merged = _Merged(self.need_max)
        if self.plan.schedule == "allgather":
            received = self._gather_kv(k, v)
            for sc in chunk.step_calls:
                merged.run(sc, q, *self._keys_of(sc, k, v, received))
            return merged
        by_round = {sc.step.round: sc for sc in chunk.step_calls}
        rounds, slots = self.plan.rounds, [None, None]
        pending = self._post_kv(0, k, v, slots) if rounds else None
        own = by_round.get(None)
        if own is not None:
            merged.run(own, q, k, v)
        for index in range(len(rounds)):
            upcoming = self._post_kv(index + 1, k, v, slots) if index + 1 < len(rounds) else None
            _wait(pending)
            sc = by_round.get(index)
            if sc is not None:
                merged.run(sc, q, *slots[index % 2])
            pending = upcoming
        return merged

    # ------------------------------------------------------------------------------ backward

    def backward(self, q, k, v, out, lse, grad_out, grad_lse):
        """``(dq, dk, dv, [gradient of each learnable tensor])``."""
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_learnable: list = [None] * len(self.learnable)
        for chunk in self.chunks:
            qs, ks = chunk.q_heads, chunk.kv_heads
            q_c, k_c, v_c = self._heads(chunk, q, k, v)
            dq_sum = _GradSum(dq[:, qs], len(chunk.step_calls))
            own_parts = sum(self.plan.rank in sc.step.sources for sc in chunk.step_calls)
            returned = sum(len(rnd.send_to) for rnd in self.plan.rounds)  # dK/dV parts from peers
            dk_sum, dv_sum = _GradSum(dk[:, ks], own_parts + returned), _GradSum(dv[:, ks], own_parts + returned)
            statistics = (out[:, qs], lse[:, qs], grad_out[:, qs], None if grad_lse is None else grad_lse[:, qs])

            def run(sc: StepCall, keys, values):
                gq, gk, gv, g_captured = sc.backward(q_c, keys, values, *statistics)
                dq_sum.add(gq)
                for captured, grad in zip(sc.score_captured, g_captured):
                    if grad is None:
                        continue
                    n = next(i for i, t in enumerate(self.learnable) if t is captured)
                    d_learnable[n] = (grad.to(working_dtype(grad.dtype)) if d_learnable[n] is None
                                      else d_learnable[n].add_(grad))
                return gk, gv  # in the working precision on both backends: what peers expect

            if self.plan.schedule == "allgather":
                self._gather_backward(chunk, run, k_c, v_c, dk_sum, dv_sum)
            else:
                self._ring_backward(chunk, run, k_c, v_c, dk_sum, dv_sum)
            for grad_sum in (dq_sum, dk_sum, dv_sum):
                grad_sum.finish()
        # A rank whose queries never reach a learnable tensor still owes it a (zero) gradient.
        grads = [torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(d_learnable, self.learnable)]
        return dq, dk, dv, grads

    def _ring_backward(self, chunk: HeadChunk, run, k, v, dk_sum: _GradSum, dv_sum: _GradSum) -> None:
        by_round = {sc.step.round: sc for sc in chunk.step_calls}
        rounds, slots = self.plan.rounds, [None, None]
        pending = self._post_kv(0, k, v, slots) if rounds else None
        own = by_round.get(None)
        if own is not None:
            gk, gv = run(own, k, v)
            dk_sum.add(gk)
            dv_sum.add(gv)
            del gk, gv
        in_flight = None  # (works, buffers receiving dK/dV of the own shard, tensors being sent)
        for index, rnd in enumerate(rounds):
            upcoming = self._post_kv(index + 1, k, v, slots) if index + 1 < len(rounds) else None
            _wait(pending)
            sends, incoming = [], None
            sc = by_round.get(index)
            if sc is not None:
                gk, gv = run(sc, *slots[index % 2])
                sends = [(gk.contiguous(), rnd.recv_from[0]), (gv.contiguous(), rnd.recv_from[0])]
                del gk, gv
            if index + 1 == len(rounds):
                slots[:] = [None, None]  # no kernel reads them any more: freed before the last exchange
            if rnd.send_to:  # the rank that got the own shard this round sends its dK/dV back
                incoming = (torch.empty_like(k, dtype=working_dtype(k.dtype)),
                            torch.empty_like(v, dtype=working_dtype(v.dtype)))
            recvs = [(t, rnd.send_to[0]) for t in incoming] if incoming else []
            self._finish(in_flight, dk_sum, dv_sum)
            in_flight = (self.exchange.post(sends, recvs), incoming, sends)
            del sends, incoming
            pending = upcoming
        self._finish(in_flight, dk_sum, dv_sum)

    @staticmethod
    def _finish(in_flight, dk_sum: _GradSum, dv_sum: _GradSum) -> None:
        if in_flight is None:
            return
        works, incoming, _ = in_flight
        _wait(works)
        if incoming is not None:
            dk_sum.add(incoming[0])
            dv_sum.add(incoming[1])

    def _gather_backward(self, chunk: HeadChunk, run, k, v, dk_sum: _GradSum, dv_sum: _GradSum) -> None:
        rnd = self.plan.rounds[0]
        received = self._gather_kv(k, v)
        back = []
        length = k.shape[2]
        for sc in chunk.step_calls:
            gk, gv = run(sc, *self._keys_of(sc, k, v, received))
            for src, part_k, part_v in zip(sc.step.sources, gk.split(length, 2), gv.split(length, 2)):
                if src == self.plan.rank:
                    dk_sum.add(part_k.contiguous())
                    dv_sum.add(part_v.contiguous())
                else:
                    back += [(part_k.contiguous(), src), (part_v.contiguous(), src)]
        del received
        incoming = {peer: (torch.empty_like(k, dtype=working_dtype(k.dtype)),
                           torch.empty_like(v, dtype=working_dtype(v.dtype))) for peer in rnd.send_to}
        _wait(self.exchange.post(back, [(t, peer) for peer, pair in incoming.items() for t in pair]))
        for part_k, part_v in incoming.values():
            dk_sum.add(part_k)
            dv_sum.add(part_v)


class ContextParallelFunction(torch.autograd.Function):
    """Inputs: this rank's q, k, v shards, the RankRun, whether the caller reads the LSE, then the
    learnable tensors (so autograd routes their gradients). Outputs: out, lse, max_scores."""

    @staticmethod
    def forward(ctx, q, k, v, run: RankRun, lse_returned: bool, *learnable):
        out, lse, max_scores = run.forward(q, k, v)
        ctx.run, ctx.lse_returned = run, lse_returned
        ctx.save_for_backward(q, k, v, out, lse)
        if max_scores is not None:
            ctx.mark_non_differentiable(max_scores)
        return out, lse, max_scores

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse, grad_max):
        q, k, v, out, lse = ctx.saved_tensors
        # Every rank runs the whole backward, whatever it needs itself: its peers wait for its shards.
        dq, dk, dv, d_learnable = ctx.run.backward(q, k, v, out, lse, grad_out,
                                                   grad_lse if ctx.lse_returned else None)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None,
                *(g if needs[5 + i] else None for i, g in enumerate(d_learnable)))
