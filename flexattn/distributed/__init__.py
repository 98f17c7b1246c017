"""Context parallelism: flex_attention over a sequence split across the ranks of a process group.

::

    from flexattn.distributed import ContextParallel
    cp = ContextParallel(block_mask, group=None, balance="mask")   # the global mask, on every rank
    q_l, k_l, v_l = cp.shard(q), cp.shard(k), cp.shard(v)
    out_l = cp.flex_attention(q_l, k_l, v_l, score_mod=alibi)
    out = cp.unshard(out_l)

``sharding`` (units and the balance modes) -> ``cost`` (the cost model) -> ``agreement`` (the
ranks' check that they were given the same mask and calls) -> ``plan`` (the plan, the same on
every rank: layouts, which K/V shards each rank needs, rounds and step masks) -> ``comm``
(torch.distributed's transfers) -> ``step`` (one step as flex_attention runs it; the merge) ->
``ring`` (the forward and backward loops) -> ``context_parallel`` (``ContextParallel``).
docs/context_parallel.md describes the design, the schedule, the agreement and the cost model.
"""

from .context_parallel import ContextParallel
from .cost import CostModel, Problem
from .plan import Plan

__all__ = ["ContextParallel", "CostModel", "Plan", "Problem"]
