"""Running one rank's plan: the forward and backward loops over its rounds and steps, and the
autograd Function that ties them together.

Ring forward, per rank: post round 1 (the first shard on its way), compute the own shard, then for
each round s: post round s+1, wait for round s, compute the shard it brought, merge. Received
shards alternate between two buffers, so a rank holds its own shard and at most two others. A
round's ops run on NCCL's stream after the work already queued (so a buffer is overwritten only
after the kernel that read it), and the wait makes the kernel wait for the transfer, not the host.

Ring backward: the same rounds bring the K/V shards again; after each step the rank sends the
step's dK/dV to the shard's owner and receives the dK/dV of its own shard from the rank it sent
it to in that round (the same pairs, reversed), one exchange in flight at a time. dQ, and the
owner's dK/dV, accumulate in float32, and dK/dV travel in float32 (each part unrounded).
Gradients of the score_mod's learnable tensors are this rank's share (see ContextParallel.flex_attention).

The gather schedule runs the same pieces with one round that brings every needed shard, one
kernel over their concatenation, and one round that returns every dK/dV.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .comm import Exchange
from .plan import RankPlan
from .step import StepCall, empty_result, merge_into, working_dtype

__all__ = ["RankRun", "ContextParallelFunction"]


def _wait(works: Optional[list]) -> None:
    for work in works or ():
        work.wait()


class _Merged:
    """The running (out, lse, max_scores) of a rank's steps."""

    def __init__(self, q: torch.Tensor, value_dim: int, need_max: bool) -> None:
        self.q, self.value_dim, self.need_max = q, value_dim, need_max
        self.out = self.lse = self.max = None

    def add(self, out: torch.Tensor, lse: torch.Tensor, max_scores: Optional[torch.Tensor]) -> None:
        if self.out is None:  # the step's own fresh outputs become the accumulators
            self.out, self.lse, self.max = out.to(working_dtype(out.dtype)), lse, max_scores
            return
        merge_into(self.out, self.lse, out, lse)
        if self.need_max:
            torch.maximum(self.max, max_scores, out=self.max)

    def result(self):
        if self.out is None:
            return empty_result(self.q, self.value_dim, self.need_max)
        return self.out.to(self.q.dtype), self.lse, self.max


class RankRun:
    """One call on one rank: its plan for the call's schedule, a StepCall per step, and the
    exchange. ``learnable``: the score_mod's captured tensors that take a gradient."""

    def __init__(self, plan: RankPlan, step_calls: list, exchange: Exchange, need_max: bool, learnable: list) -> None:
        self.plan, self.step_calls, self.exchange = plan, step_calls, exchange
        self.need_max, self.learnable = need_max, learnable
        self._by_round = {sc.step.round: sc for sc in step_calls}

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

    # ------------------------------------------------------------------------------ forward

    def forward(self, q, k, v):
        k, v = k.contiguous(), v.contiguous()
        merged = _Merged(q, v.shape[-1], self.need_max)
        if self.plan.schedule == "allgather":
            received = self._gather_kv(k, v)
            for sc in self.step_calls:
                merged.add(*sc.forward(q, *self._keys_of(sc, k, v, received), self.need_max))
            return merged.result()
        rounds, slots = self.plan.rounds, [None, None]
        pending = self._post_kv(0, k, v, slots) if rounds else None
        own = self._by_round.get(None)
        if own is not None:
            merged.add(*own.forward(q, k, v, self.need_max))
        for index in range(len(rounds)):
            upcoming = self._post_kv(index + 1, k, v, slots) if index + 1 < len(rounds) else None
            _wait(pending)
            sc = self._by_round.get(index)
            if sc is not None:
                merged.add(*sc.forward(q, *slots[index % 2], self.need_max))
            pending = upcoming
        return merged.result()

    # ------------------------------------------------------------------------------ backward

    def backward(self, q, k, v, out, lse, grad_out, grad_lse):
        """``(dq, dk, dv, [gradient of each learnable tensor])``."""
        k, v, grad_out = k.contiguous(), v.contiguous(), grad_out.contiguous()
        dtype = working_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
        d_learnable: list = [None] * len(self.learnable)

        def run(sc: StepCall, keys, values):
            gq, gk, gv, g_captured = sc.backward(q, keys, values, out, lse, grad_out, grad_lse)
            dq.add_(gq)
            for captured, grad in zip(sc.score_captured, g_captured):
                if grad is None:
                    continue
                n = next(i for i, t in enumerate(self.learnable) if t is captured)
                d_learnable[n] = grad.to(dtype) if d_learnable[n] is None else d_learnable[n].add_(grad)
            return gk.to(dtype), gv.to(dtype)  # float32 already on both backends: what peers expect

        if self.plan.schedule == "allgather":
            self._gather_backward(run, k, v, dk, dv)
        else:
            self._ring_backward(run, k, v, dk, dv)
        # A rank whose queries never reach a learnable tensor still owes it a (zero) gradient.
        grads = [torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(d_learnable, self.learnable)]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads

    def _ring_backward(self, run, k, v, dk, dv) -> None:
        rounds, slots = self.plan.rounds, [None, None]
        pending = self._post_kv(0, k, v, slots) if rounds else None
        own = self._by_round.get(None)
        if own is not None:
            gk, gv = run(own, k, v)
            dk.add_(gk)
            dv.add_(gv)
        in_flight = None  # (works, buffers receiving dK/dV of the own shard, tensors being sent)
        for index, rnd in enumerate(rounds):
            upcoming = self._post_kv(index + 1, k, v, slots) if index + 1 < len(rounds) else None
            _wait(pending)
            sends, incoming = [], None
            sc = self._by_round.get(index)
            if sc is not None:
                gk, gv = run(sc, *slots[index % 2])
                sends = [(gk.contiguous(), rnd.recv_from[0]), (gv.contiguous(), rnd.recv_from[0])]
            if rnd.send_to:  # the rank that got the own shard this round sends its dK/dV back
                incoming = (torch.empty_like(dk), torch.empty_like(dv))
            recvs = [(t, rnd.send_to[0]) for t in incoming] if incoming else []
            self._finish(in_flight, dk, dv)
            in_flight = (self.exchange.post(sends, recvs), incoming, sends)
            pending = upcoming
        self._finish(in_flight, dk, dv)

    @staticmethod
    def _finish(in_flight, dk, dv) -> None:
        if in_flight is None:
            return
        works, incoming, _ = in_flight
        _wait(works)
        if incoming is not None:
            dk.add_(incoming[0])
            dv.add_(incoming[1])

    def _gather_backward(self, run, k, v, dk, dv) -> None:
        rnd = self.plan.rounds[0]
        received = self._gather_kv(k, v)
        back = []
        length = k.shape[2]
        for sc in self.step_calls:
            gk, gv = run(sc, *self._keys_of(sc, k, v, received))
            for src, part_k, part_v in zip(sc.step.sources, gk.split(length, 2), gv.split(length, 2)):
                if src == self.plan.rank:
                    dk.add_(part_k)
                    dv.add_(part_v)
                else:
                    back += [(part_k.contiguous(), src), (part_v.contiguous(), src)]
        incoming = {peer: (torch.empty_like(dk), torch.empty_like(dv)) for peer in rnd.send_to}
        _wait(self.exchange.post(back, [(t, peer) for peer, pair in incoming.items() for t in pair]))
        for part_k, part_v in incoming.values():
            dk.add_(part_k)
            dv.add_(part_v)


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
