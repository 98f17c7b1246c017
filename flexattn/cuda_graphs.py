"""What a call may keep for later calls when CUDA graphs are about.

flexattn keeps a few device tensors across calls: the tensor-descriptor scratch of a stream, the
all-full BlockMask of a call that passes none, the device copies of a mod's own constants, and (in
a compiled call) the transposed tables of a mask. Kept from inside a CUDA-graph capture, or from a
CUDA-graph tree's warm-up (torch.compile's mode="reduce-overhead"), such a tensor would live in the
graph's private memory pool: the tree refuses a live tensor there that is no output of the graph
("tensors in the cudagraph pool not tracked as outputs"), and the pool's memory is the graph's to
reuse. Both run on a stream of their own, never the device's default stream, so a call keeps what
it allocates only on the default stream and outside a capture; elsewhere it allocates anew each
call (a few microseconds) and lets it go. A mod's constants are the exception: they come from host
memory, which a capture may not copy from, so a warm-up has a worker thread copy them (the pool
takes only the warming thread's allocations) and keeps those copies for the capture.
"""

import concurrent.futures
import threading

import torch

__all__ = ["capturing", "may_keep_allocations", "copied_outside_graph_pools"]

_copier: "concurrent.futures.ThreadPoolExecutor | None" = None
_copier_lock = threading.Lock()


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and this thread's current stream is capturing a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def may_keep_allocations(device: torch.device) -> bool:
    """Whether device tensors allocated now may be kept for later calls (see the module docstring)."""
    if device.type != "cuda":
        return True
    return (not torch.cuda.is_current_stream_capturing()
            and torch.cuda.current_stream(device) == torch.cuda.default_stream(device))


def copied_outside_graph_pools(tensors: tuple, device: torch.device) -> tuple:
    """``tensors`` (CPU tensors or None) copied to ``device`` by a worker thread, for keeping.

    A CUDA-graph tree's warm-up routes every allocation of its own thread into the graph's pool, so
    a copy made there could not be kept; one made by another thread is not in the pool. Keeping it
    matters for the capture that follows: a copy from host memory made inside a capture is not
    allowed. Not to be called while this thread captures (the worker waits for its copies)."""
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexattn-copy")

    def copy() -> tuple:
        out = tuple(None if t is None else t.to(device) for t in tensors)
        if torch.device(device).type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # done before any stream reads them
        return out

    return _copier.submit(copy).result()
