"""torch's context parallelism for flex_attention, as the multi-GPU run compares with it
(``python -m benchmarks.context_parallel_gpus --torch``).

torch's design (``torch.distributed.tensor.experimental._attention`` in torch 2.11):
``_ContextParallel(seq_dim=2, FLEX)`` on a module that calls compiled torch ``flex_attention``: its
pre-hook all-gathers K and V; ``_context_parallel_shard`` shards q, k, v and rebuilds the BlockMask
for the rank's queries, with no load balancer (``none``), ``_HeadTailLoadBalancer`` (``head_tail``)
or ``_PTRRLoadBalancer`` (``ptrr``). These are torch's private names: this module is where a torch
release that moves them needs a change.
"""

from __future__ import annotations

import torch

from flexattn.bench.common import compile_torch_flex
from flexattn.masks.layout import cdiv

__all__ = ["TORCH_BALANCES", "TorchAttention", "TorchBaseline", "torch_block_mask"]

TORCH_BALANCES = ("none", "head_tail", "ptrr")


class TorchAttention(torch.nn.Module):
    """The layer torch's ``_ContextParallel`` wraps: its pre-hook all-gathers K and V."""

    def __init__(self, attend, gqa: bool) -> None:
        super().__init__()
        self.attend, self.gqa = attend, gqa

    def forward(self, query, key, value, block_mask):
        return self.attend(query, key, value, block_mask=block_mask, enable_gqa=self.gqa)


def torch_block_mask(bm):
    """torch's BlockMask with flexattn's tables (the same tiles, no second evaluation of the mask).
    torch derives its transposed tables from dense maps as wide as the index tables, so those are
    widened to every key block."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    cols = cdiv(bm.seq_lengths[1], bm.BLOCK_SIZE[1])

    def widened(idx):
        if idx is None or idx.shape[-1] >= cols:
            return idx
        return torch.nn.functional.pad(idx, (0, cols - idx.shape[-1]))

    return TorchBlockMask.from_kv_blocks(bm.kv_num_blocks, widened(bm.kv_indices), bm.full_kv_num_blocks,
                                         widened(bm.full_kv_indices), BLOCK_SIZE=tuple(bm.BLOCK_SIZE),
                                         mask_mod=bm.mask_mod, seq_lengths=tuple(bm.seq_lengths))


class TorchBaseline:
    """torch's flex_attention, compiled (on CUDA; eager on the CPU), and at world > 1 its context
    parallelism on a device mesh. Made once per process, at the first torch case."""

    def __init__(self, world: int, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        self.world, self.device = world, device
        static = compile_torch_flex()  # also lifts Dynamo's recompile limits (every case recompiles)
        if device.type == "cuda":
            self.compiled = {"static": static, "dynamic": torch.compile(torch_flex, dynamic=True)}
        else:  # torch compiles flex_attention for CUDA; on the CPU it runs eager, forward only
            self.compiled = {None: torch_flex}
        self.layers: dict = {}
        self.mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (world,))

    def attend(self, compile_mode):
        return self.compiled[compile_mode]

    def layer(self, compile_mode, gqa: bool):
        """The module with torch's context parallelism applied (once per compile mode)."""
        layer = self.layers.get(compile_mode)
        if layer is None:
            from torch.distributed.tensor.experimental._attention import _ContextParallel
            from torch.distributed.tensor.parallel import parallelize_module

            layer = TorchAttention(self.compiled[compile_mode], gqa)
            parallelize_module(layer, self.mesh, _ContextParallel(
                seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
            self.layers[compile_mode] = layer
        return layer

    def load_balancer(self, balance: str, tbm, tokens: int):
        from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer, _PTRRLoadBalancer

        if balance == "none":
            return None
        if balance == "head_tail":
            return _HeadTailLoadBalancer(tokens, self.world, self.device)
        return _PTRRLoadBalancer(tbm, self.world)

    def shard(self, buffers: list, load_balancer) -> list:
        """torch's shards of ``buffers`` (tensors and a BlockMask), each along dim 2."""
        from torch.distributed.tensor.experimental._attention import _context_parallel_shard

        return _context_parallel_shard(self.mesh, buffers, [2] * len(buffers), load_balancer)

    def unshard(self, tensors: list, load_balancer) -> list:
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        return context_parallel_unshard(self.mesh, tensors, [2] * len(tensors), load_balancer)

    def rank_rows(self, balance: str, tbm, tokens: int, block: int) -> list:
        """The query-block rows each rank holds in torch's layout (for the model)."""
        lb = self.load_balancer(balance, tbm, tokens)
        order = torch.arange(tokens) if lb is None else lb._generate_indices()[0].cpu().long()
        return [torch.unique(part // block) for part in order.reshape(self.world, -1)]
