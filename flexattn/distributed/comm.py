"""What context parallelism asks of torch.distributed for its transfers: point-to-point rounds
(the ranks' agreement check is agreement.py).

Only APIs present since torch 2.0 are used (``P2POp``, ``batch_isend_irecv``,
``get_global_rank``), so the module works on every torch flexattn supports. NCCL runs the p2p ops of
a round on its own stream, ordered after the work already queued on the current stream, and
``Work.wait()`` makes the current stream wait for them without blocking the host: the transfer of
the next shard overlaps the kernel of the current one. On gloo the same calls run on the CPU.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import InvalidInputError

__all__ = ["Exchange", "as_process_group"]


def as_process_group(group):
    """``group`` as a ProcessGroup: None is the default group, a 1-D DeviceMesh gives its group."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError(
            "ContextParallel needs torch.distributed: call torch.distributed.init_process_group(...) first "
            "(backend 'nccl' for CUDA tensors, 'gloo' for CPU tensors)"
        )
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group") and hasattr(group, "mesh"):  # a DeviceMesh
        if group.mesh.dim() != 1:
            raise InvalidInputError(
                f"ContextParallel: group is a {group.mesh.dim()}-D DeviceMesh; pass the 1-D mesh of the "
                "context-parallel dimension, e.g. mesh['cp']"
            )
        return group.get_group()
    return group


class Exchange:
    """Sends and receives of one process group, addressed by rank in the group."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # P2POp takes global ranks (its group_peer argument is newer than torch 2.11's oldest peers).
        self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> list:
        """Start the sends and receives of one round together; returns their Work objects."""
        ops = [dist.P2POp(dist.isend, tensor, self._global[peer], self.group) for tensor, peer in sends]
        ops += [dist.P2POp(dist.irecv, tensor, self._global[peer], self.group) for tensor, peer in recvs]
        return dist.batch_isend_irecv(ops) if ops else []
