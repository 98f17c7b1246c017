"""``ContextParallel``: flex_attention over a sequence split across the ranks of a process group."""

from __future__ import annotations

import logging
import sys
from typing import Optional

import torch
import torch.distributed as dist

from ..codegen import debug_enabled
from ..errors import InvalidInputError
from ..kernels.launch import FLOAT8_DTYPES
from ..lowering import mod_index_dtype
from ..masks import as_block_mask
from ..masks.layout import cdiv
from ..mods import noop_mask
from ..options import AuxRequest
from ..request import check_block_mask, check_captured_devices, check_tensors, options_of, request_of, wants_grad
from ..trace import trace_mod
from .agreement import Agreement
from .comm import Exchange, as_process_group
from .cost import CostModel, Problem
from .memory import RankShapes, choose_head_chunks
from .plan import SCHEDULES, Plan, tiles_digest
from .ring import ContextParallelFunction, HeadChunk, RankRun
from .sharding import BALANCE_MODES, Layout
from .step import chunk_step_calls

__all__ = ["ContextParallel"]

logger = logging.getLogger("flexattn.distributed")

_ROLES = ("query", "key")

_FIX_MASK = ("Every rank must build the same global mask (same mask_mod, lengths, block size and captured tensors, "
             "e.g. document ids broadcast from rank 0) and pass the same balance and schedule")
_FIX_CALL = ("Every rank must make the same calls in the same order: cp.flex_attention with its own shards of the "
             "same tensors (same batch, heads, head_dim, dtype, requires_grad), the same score_mod reading the same "
             "tensors and numbers, scale and options, on the same ContextParallel")
_FIX_UNSHARD = "Every rank must call cp.unshard with its own shard of the same tensor (cp.flex_attention's output)"


def _mod_facts(check: Agreement, mod, kind: str, device: Optional[torch.device] = None) -> list:
    """State what a mod computes with: its traced graph (its code) and each captured input it reads
    now: tensors by contents, the Python numbers it reads (inputs of the graph, trace/numbers.py)
    by value. ``device``: a call's, where its tensors must be (as in any call). Returns the inputs."""
    traced, captured = trace_mod(mod, kind)
    if device is not None:
        check_captured_devices(traced, captured, device)
    check.digest(f"the {kind}'s traced graph", traced.signature_text())
    names = [spec.name for spec in traced.captured]
    for i, value in enumerate(captured):  # every input passed at run time, named where the trace names it
        check.contents(f"the {kind}'s captured input {names[i] if i < len(names) else i!r}", value)
    return captured


def _mask_facts(check: Agreement, bm) -> None:
    """State what every rank's BlockMask must agree on: lengths, block size, the tables' shapes and
    the sets of tiles they list, and the mask_mod (_mod_facts)."""
    check.value("Q_LEN, KV_LEN", tuple(bm.seq_lengths))
    check.value("BLOCK_SIZE", tuple(bm.BLOCK_SIZE))
    check.value("shape of the tables (kv_indices)", tuple(bm.kv_indices.shape))
    cols = max(bm.kv_indices.shape[-1], cdiv(bm.seq_lengths[1], bm.BLOCK_SIZE[1]))
    check.digest("partial tiles (kv_num_blocks, kv_indices)", tiles_digest(bm.kv_num_blocks, bm.kv_indices, cols))
    full = None if bm.full_kv_num_blocks is None else tiles_digest(bm.full_kv_num_blocks, bm.full_kv_indices, cols)
    check.value("full tiles given", full is not None)
    if full is not None:
        check.digest("full tiles (full_kv_num_blocks, full_kv_indices)", full)
    _mod_facts(check, bm.mask_mod or noop_mask, "mask_mod")


class _Unshard(torch.autograd.Function):
    """All-gather a rank's shard into the global sequence. Backward: every rank computes the same
    loss from the whole output, so the gradient of this rank's shard is its own slice of the
    output's gradient (no communication)."""

    @staticmethod
    def forward(ctx, shard, layout: Layout, order: torch.Tensor, mine: torch.Tensor, group):
        parts = [torch.empty_like(shard) for _ in range(layout.world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        whole = shard.new_empty(*shard.shape[:2], layout.padded_length, *shard.shape[3:])
        whole.index_copy_(2, order, torch.cat(parts, dim=2))
        ctx.layout, ctx.mine = layout, mine
        return whole.narrow(2, 0, layout.length).contiguous()

    @staticmethod
    def backward(ctx, grad):
        pad = ctx.layout.padded_length - ctx.layout.length
        if pad:
            grad = torch.nn.functional.pad(grad, (0, 0) * (grad.dim() - 3) + (0, pad))
        return grad.index_select(2, ctx.mine), None, None, None, None


class ContextParallel:
    """flex_attention over a sequence too long for one device, split across a process group.

    Build it once per mask (every layer that shares the mask shares it), from the *global*
    BlockMask, the same on every rank; mods keep using global positions::

        cp = ContextParallel(block_mask, group=None, balance="mask")
        q_l, k_l, v_l = cp.shard(q), cp.shard(k), cp.shard(v)
        out_l = cp.flex_attention(q_l, k_l, v_l, score_mod=alibi)
        out = cp.unshard(out_l)          # the whole sequence again (tests, the last layer)

    Each rank holds ``1 / world_size`` of the tokens (its *shard*). K/V shards travel between
    ranks only where the mask needs them ([Note] The plan in flexattn/distributed/plan.py;
    docs/context_parallel.md).

    Args:
        block_mask: the BlockMask of the whole sequence (flexattn's or torch's), on this rank's
            device, identical on every rank (checked, captured tensors' contents included: a
            difference raises RankDisagreementError on every rank, naming it).
        group: a ProcessGroup, a 1-D DeviceMesh, or None for the default group (NCCL for CUDA
            tensors, gloo for CPU tensors).
        balance: how tokens are dealt to ranks. ``"mask"``: from the mask's tile counts, so every
            rank computes about as many full and partial tiles as the others (the permutation is in
            ``plan.q_layout``); ``"zigzag"``: rank r holds chunks r and 2R-1-r of 2R (causal masks);
            ``"contiguous"``: rank r holds the r-th R-th of the sequence.
        schedule: ``"ring"`` (one shard per step, the next arriving during the current step's
            kernel; at most two received shards held), ``"allgather"`` (every needed shard at once,
            one kernel), or ``"auto"``: the faster by the cost model, per call size.
        cost_model: the :class:`~flexattn.distributed.CostModel` ``"auto"`` asks (default: by device).
        head_chunks: run the schedule for this many chunks of the key/value heads, one after the
            other (a divisor of the key/value heads; each chunk keeps whole GQA groups): the
            ring's query-sized working buffers (float32 sums, dQ and dK/dV parts, received shards)
            shrink by that factor, for as many more rounds and kernel launches. ``"auto"`` (the
            default) picks the fewest chunks whose working buffers fit a quarter of the rank's own
            tensors, leaving small calls whole ([Note] A rank's memory in memory.py;
            docs/context_parallel.md, "Memory").

    Padding: the sequence is cut into units of ``lcm(Q_BLOCK, KV_BLOCK)`` tokens and padded at its
    end to a whole number of units per rank (two per rank for zigzag). :meth:`shard` pads with
    zeros; padded keys are masked, padded queries give 0 (LSE -inf) and :meth:`unshard` drops them.

    Attributes:
        plan: the :class:`~flexattn.distributed.Plan` (layouts, tiles per rank pair, which shards
            each rank needs, ``plan.schedule``: the schedule the last call ran).
        rank, world_size, group.
    """

    def __init__(self, block_mask, group=None, balance: str = "mask", *, schedule: str = "auto",
                 cost_model: Optional[CostModel] = None, head_chunks="auto") -> None:
        self.group = as_process_group(group)
        self.exchange = Exchange(self.group)
        self.rank, self.world_size = self.exchange.rank, self.exchange.world_size
        with Agreement(self.group, "the block_mask", _FIX_MASK) as check:
            if balance not in BALANCE_MODES:
                raise InvalidInputError(f"ContextParallel: balance must be one of {BALANCE_MODES}, got {balance!r}")
            if schedule not in SCHEDULES:
                raise InvalidInputError(f"ContextParallel: schedule must be one of {SCHEDULES}, got {schedule!r}")
            if head_chunks != "auto" and not (isinstance(head_chunks, int) and head_chunks >= 1):
                raise InvalidInputError(
                    f"ContextParallel: head_chunks must be 'auto' or a positive int, got {head_chunks!r}")
            bm = as_block_mask(block_mask)
            device = bm.kv_num_blocks.device
            if dist.get_backend(self.group) == "nccl" and device.type != "cuda":
                raise InvalidInputError(
                    f"ContextParallel: the group's backend is NCCL but the block_mask is on {device}; build it on "
                    "this rank's GPU (create_block_mask(..., device='cuda')), where the tensors will be"
                )
            _mask_facts(check, bm)
            check.value("balance", balance)
            check.value("schedule", schedule)
            check.value("head_chunks", head_chunks)
            self.head_chunks = head_chunks
            self.plan = Plan(bm, self.world_size, balance, schedule, cost_model)
        # Every later call states which ContextParallel it is on: two objects over one group that
        # ranks mix up would otherwise run different plans against each other.
        self._identity = check.agreed
        self.device = device
        self._positions: dict = {}
        logger.debug("rank %d: %s", self.rank, self.plan.describe())

    # ------------------------------------------------------------------------------ sharding

    def _layout(self, length: int, role: Optional[str], local: bool) -> tuple[str, Layout]:
        """The role ("query" or "key") and layout of a tensor whose dim 2 has ``length`` positions
        (a shard's when ``local``, else the global sequence's)."""
        layouts = {"query": self.plan.q_layout, "key": self.plan.kv_layout}
        if role is not None and role not in layouts:
            raise InvalidInputError(f"ContextParallel: role must be 'query' or 'key', got {role!r}")

        def size(layout: Layout) -> int:
            return layout.local_length if local else layout.length

        what = "this rank's shard" if local else "the global sequence"
        if role is None:
            fits = [name for name, layout in layouts.items() if size(layout) == length]
            if len(fits) == 2 and layouts["query"] is not layouts["key"]:
                raise InvalidInputError(
                    f"ContextParallel: dim 2 has {length} positions, the length of {what} of both the queries and "
                    "the keys, which the plan lays out differently; pass role='query' or role='key'"
                )
            if not fits:
                sizes = " or ".join(str(n) for n in sorted({size(layout) for layout in layouts.values()}))
                fix = ("pass a shard from cp.shard, or cp.flex_attention's output" if local
                       else "the block_mask's Q_LEN or KV_LEN")
                raise InvalidInputError(
                    f"ContextParallel: dim 2 has {length} positions, but {what} has {sizes} ({fix})")
            role = fits[0]
        if size(layouts[role]) != length:
            raise InvalidInputError(
                f"ContextParallel: dim 2 has {length} positions, but {what} of the {role}s has {size(layouts[role])}"
            )
        return role, layouts[role]

    def _positions_of(self, role: str, layout: Layout, rank: Optional[int], device: torch.device) -> torch.Tensor:
        # The key leaves out the layout: it is the plan's for ``role``, fixed for this object.
        key = (role, rank, device)
        positions = self._positions.get(key)
        if positions is None:
            if rank is None:  # every rank's, in rank order: where the all_gather's parts go
                positions = torch.cat([layout.positions(r) for r in range(layout.world)])
            else:
                positions = layout.positions(rank)
            positions = self._positions[key] = positions.to(device)
        return positions

    def shard(self, x: torch.Tensor, role: Optional[str] = None) -> torch.Tensor:
        """This rank's part of ``x``'s dim 2 (the sequence), in the plan's order.

        ``x``: ``[B, H, L, ...]`` with L the mask's Q_LEN or KV_LEN, the same tensor on every rank.
        Padding positions are zeros. Differentiable (the gradient goes to x's positions).
        ``role``: "query" or "key", needed only where queries and keys have different lengths but
        the same shard length (cross-attention), so the length does not tell.
        """
        role, layout = self._layout(x.shape[2], role, local=False)
        pad = layout.padded_length - layout.length
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.index_select(2, self._positions_of(role, layout, self.rank, x.device))

    def unshard(self, x: torch.Tensor, role: Optional[str] = None) -> torch.Tensor:
        """The global sequence from every rank's shard ``x`` (an all_gather): for tests and a model's
        last layer. Padding is dropped. In the backward each rank keeps its own slice of the
        gradient, which is right when every rank computes the same loss from the whole result.
        ``role`` as in :meth:`shard`."""
        with Agreement(self.group, "cp.unshard", _FIX_UNSHARD) as check:
            role, layout = self._layout(x.shape[2], role, local=True)
            check.value("shape", tuple(x.shape))
            check.value("dtype", str(x.dtype))
            check.value("role", role)
        return _Unshard.apply(x, layout, self._positions_of(role, layout, None, x.device),
                              self._positions_of(role, layout, self.rank, x.device), self.group)

    # ------------------------------------------------------------------------------ attention

    def _check_shards(self, query, key, value) -> None:
        """What a call under context parallelism needs beyond any call's checks (request.py): one
        dtype that is not FP8, and this rank's shards of the plan's sequences."""
        if not query.dtype == key.dtype == value.dtype or query.dtype in FLOAT8_DTYPES:
            raise InvalidInputError(
                f"cp.flex_attention: query, key and value must have one dtype, float16, bfloat16, float32 or "
                f"float64 (context parallelism runs no FP8 or mixed dtypes), got {query.dtype}, {key.dtype} and "
                f"{value.dtype}"
            )
        for name, length, layout in (("query", query.shape[2], self.plan.q_layout),
                                     ("key", key.shape[2], self.plan.kv_layout)):
            if length != layout.local_length:
                raise InvalidInputError(
                    f"cp.flex_attention: {name} has {length} positions on dim 2, but this rank's shard holds "
                    f"{layout.local_length} ({layout.length} positions padded to {layout.padded_length}, over "
                    f"{layout.world} ranks); pass cp.shard({name[0]}), not the whole sequence"
                )

    def _head_chunks(self, shapes: RankShapes, schedule: str) -> int:
        """The chunks of heads this call runs (the constructor's ``head_chunks``)."""
        if self.head_chunks == "auto":
            return choose_head_chunks(shapes, self.world_size, schedule)
        if shapes.kv_heads % self.head_chunks:
            raise InvalidInputError(
                f"cp.flex_attention: head_chunks={self.head_chunks} does not divide the {shapes.kv_heads} key/value "
                "heads (each chunk takes whole groups of query heads); pass ContextParallel(..., head_chunks=n) with "
                f"n a divisor of {shapes.kv_heads}, or 'auto'"
            )
        return self.head_chunks

    def flex_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None,
                       scale: Optional[float] = None, enable_gqa: bool = False, kernel_options: Optional[dict] = None,
                       *, return_aux: Optional[AuxRequest] = None):
        """flex_attention of this rank's query shard against the whole sequence's keys.

        Same arguments and results as :func:`flexattn.flex_attention` (without ``block_mask``, which
        the plan holds): ``query`` [B, Hq, shard, E], ``key``/``value`` [B or 1, Hkv, shard, E/Ev],
        each from :meth:`shard`; ``score_mod`` in global positions; ``return_aux=AuxRequest(lse=...,
        max_scores=...)`` returns ``(out, AuxOutput)`` for this rank's queries, the LSE
        differentiable. Every rank must make the same calls, and run the backward of each: each
        call is checked across ranks first (docs/context_parallel.md, "Agreement between ranks"),
        and a difference raises :class:`~flexattn.errors.RankDisagreementError` on every rank.

        Gradients reach q, k and v of every rank (dK/dV return to the shard's owner) and the
        score_mod's learnable tensors: each rank's gradient there is its own queries' share, like
        that of every other parameter under context parallelism, so the data-parallel reduction
        over the context-parallel ranks (or ``dist.all_reduce(t.grad)``) sums them.
        """
        with Agreement(self.group, "the call", _FIX_CALL) as check:
            check.digest("the ContextParallel called (its block_mask, balance and schedule)", self._identity)
            # The checks of every call (request.py), then those of context parallelism.
            check_tensors(query, key, value, enable_gqa)
            options = options_of(kernel_options)
            scale, outputs = request_of(query, scale, False, return_aux)
            need_max = outputs.need_max
            self._check_shards(query, key, value)
            check_block_mask(self.plan.block_mask, query, None)  # the global mask: its lengths are not a shard's
            check.value("score_mod given", score_mod is not None)
            learnable = []
            if score_mod is not None:
                learnable = [t for t in _mod_facts(check, score_mod, "score_mod", query.device)
                             if isinstance(t, torch.Tensor) and t.requires_grad]
            # The step masks read the mask_mod's captured tensors as they are now, on every call.
            _mod_facts(check, self.plan.block_mask.mask_mod or noop_mask, "mask_mod", query.device)
            needs_grad = wants_grad(query, key, value, learnable)
            B, Hq, _, E = query.shape
            Bk, Hkv, _, Ev = value.shape
            problem = Problem(B, Hq, Bk, Hkv, E, Ev, query.element_size())
            facts = {
                "batch": B, "query heads": Hq, "key/value batch": Bk, "key/value heads": Hkv, "head_dim": E,
                "value head_dim": Ev, "query and key shard lengths": (query.shape[2], key.shape[2]),
                "dtype": str(query.dtype), "enable_gqa": enable_gqa, "gradient needed": needs_grad,
                "max_scores requested": need_max, "scale": scale, "kernel_options": repr(sorted(options.items())),
            }
            for name, fact in facts.items():
                check.value(name, fact)
            plan = self.plan
            # A cost model may differ by rank (CostModel.for_device): the choice itself must agree.
            schedule = plan.schedule = plan.choose_schedule(problem)
            check.value("schedule chosen", schedule)
            rank_plan = plan.rank_plan(self.rank, schedule)
            chunks = self._head_chunks(RankShapes(B, Hq, Bk, Hkv, query.shape[2], key.shape[2], E, Ev,
                                                  query.element_size()), schedule)
            check.value("head chunks", chunks)
            q_len, kv_len = plan.block_mask.seq_lengths
            position_dtype = (mod_index_dtype(score_mod, "score_mod", B, Hq, q_len, kv_len) if score_mod is not None
                              else torch.int32)
            head_chunks = [HeadChunk(*chunk) for chunk in chunk_step_calls(
                rank_plan.steps, chunks, score_mod, position_dtype, query, Hkv, options, scale, needs_grad, need_max)]
        if debug_enabled():
            print(f"[flexattn] context parallel rank {self.rank}/{self.world_size}: schedule={schedule}, "
                  f"{len(rank_plan.steps)} steps, {chunks} head chunks, receives {rank_plan.received_shards()} and "
                  f"sends {rank_plan.sent_shards()} K/V shards; {plan.describe()}", file=sys.stderr)
        logger.debug("rank %d: schedule %s, %d steps, %d head chunks", self.rank, schedule, len(rank_plan.steps),
                     chunks)
        run = RankRun(rank_plan, head_chunks, self.exchange, need_max, learnable)
        if needs_grad:
            out, lse, max_scores = ContextParallelFunction.apply(query, key, value, run, outputs.need_lse, *learnable)
        else:
            with torch.no_grad():
                out, lse, max_scores = run.forward(query, key, value)
        return outputs.returned(out, lse, max_scores)
