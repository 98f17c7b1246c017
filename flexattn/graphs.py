"""What a call may keep for later calls when CUDA graphs are about.

flexattn keeps a few device tensors across calls: the tensor-descriptor scratch of a stream, the
all-full BlockMask of a call that passes none, the device copies of a mod's own constants, and (in
a compiled call) the transposed tables of a mask. Kept from inside a CUDA-graph capture, or from a
CUDA-graph tree's warm-up (torch.compile's mode="reduce-overhead"), such a tensor would live in the
graph's private memory pool: the tree refuses a live tensor there that is no output of the graph
("tensors in the cudagraph pool not tracked as outputs"), and the pool's memory is the graph's to
reuse. Both run on a stream of their own, never the device's default stream, so a call keeps what
it allocates only on the default stream and outside a capture; elsewhere it allocates anew each
call (a few microseconds) and lets it go.
"""

import torch

__all__ = ["may_keep_allocations"]


def may_keep_allocations(device: torch.device) -> bool:
    """Whether device tensors allocated now may be kept for later calls (see the module docstring)."""
    if device.type != "cuda":
        return True
    return (not torch.cuda.is_current_stream_capturing()
            and torch.cuda.current_stream(device) == torch.cuda.default_stream(device))
