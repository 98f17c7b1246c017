"""What a call may keep for later calls, and for which stream, when streams and CUDA graphs are about.

flexattn keeps a few device tensors across calls: the tensor-descriptor scratch of a stream, the
all-full BlockMask of a call that passes none, the device copies of a mod's own constants, and (in
a compiled call) the transposed tables of a mask. Three rules keep them right:

- **Per stream.** What a call made is kept for the stream it was made on (``stream_key``), so a
  later call on that stream reads it after the work that made it, by stream order, with no event
  and no sync. A server that runs flexattn on a stream of its own keeps its own set: its steady
  state allocates nothing per call, as on the default stream.
- **Never into a graph's pool.** Kept from inside a CUDA-graph capture, or from a CUDA-graph
  tree's warm-up (torch.compile's mode="reduce-overhead", which runs on the tree's own stream with
  that thread's allocations routed into the graph's private pool), such a tensor would live in the
  pool: the tree refuses a live tensor there that is no output of the graph ("tensors in the
  cudagraph pool not tracked as outputs"), and the pool's memory is the graph's to reuse. There a
  call allocates anew (a few microseconds) and lets it go.
- **A capture reads nothing kept that may be replaced.** A graph holds raw pointers: a kept tensor
  it read could be evicted or grown later and its memory reused under the graph. So a capture
  makes its own scratch and all-full tables, in the graph's pool, which the graph owns.

A mod's constants are the exception to "allocates anew": they come from host memory, which a
capture may not copy from, so a warm-up has a worker thread copy them (the pool takes only the
warming thread's allocations) and keeps those copies for the capture.
"""

import sys
import concurrent.futures
import threading

import torch

__all__ = ["capturing", "may_keep_allocations", "stream_key", "StreamMark", "mark_stream", "copied_outside_graph_pools"]

_copier: "concurrent.futures.ThreadPoolExecutor | None" = None
_copier_lock = threading.Lock()


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and this thread's current stream is capturing a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def stream_key(device: torch.device):
    """The key of what calls on ``device``'s current stream keep: its raw stream handle (None off CUDA)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a handle, without a Stream object
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def may_keep_allocations(device: torch.device) -> bool:
    """Whether device tensors allocated now may be kept for later calls on this stream (see the
    module docstring)."""
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    stream = torch.cuda.current_stream(device)
    return stream == torch.cuda.default_stream(device) or not _graph_tree_stream(stream, device)


def _graph_tree_stream(stream, device: torch.device) -> bool:
    """Whether ``stream`` is the stream of this thread's CUDA-graph tree on ``device``, whose
    warm-ups allocate into the graph's pool. torch keeps no public record of that, so this reads
    the tree manager; should its internals move, every side stream counts as one (nothing kept
    there: slower, never wrong)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # no tree can exist before torch.compile loaded the module
        return False
    # A thread that reaches no tree managers runs no tree. On torch 2.11, asking from such a thread
    # (autograd's backward threads, unless a tree stashed them there) fails an assertion, which the
    # safe answer below turned into "nothing kept" for every compiled backward on a side stream.
    in_tls = getattr(torch._C, "_is_key_in_tls", None)
    if (in_tls is not None and not hasattr(getattr(trees, "local", None), "tree_manager_containers")
            and not in_tls("tree_manager_containers")):
        return False
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = trees.get_manager(index, create_if_none_exists=False)
        return manager is not None and manager.stream == stream
    except Exception:  # the internals moved: the safe answer
        return True


class StreamMark:
    """Device work that later calls read, enqueued on one stream (BlockMask's derived data): the
    stream's key and an event recorded after the work. A call on that stream reads it after the
    work by stream order; a call on another stream first makes its stream wait for the event (once
    per stream). Once the event is seen complete the mark is ``done`` and costs nothing more."""

    __slots__ = ("stream", "event", "waited", "done")

    def __init__(self, stream, event) -> None:
        self.stream, self.event, self.waited, self.done = stream, event, set(), False

    def order_after(self, device: torch.device) -> None:
        """Make the current stream's next work on ``device`` follow the marked work."""
        if torch.cuda.is_current_stream_capturing():
            # A capture may not wait for an event recorded outside it: its replays come later, after
            # the capture ends, by when the work enqueued before it began has long run.
            return
        key = stream_key(device)
        if key != self.stream and key not in self.waited:
            torch.cuda.current_stream(device).wait_event(self.event)
            self.waited.add(key)
        elif self.event.query():
            self.done = True


def mark_stream(device: torch.device) -> "StreamMark | None":
    """A StreamMark after the work enqueued so far on ``device``'s current stream (None off CUDA or
    inside a capture, whose work runs only when the graph replays)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    event = torch.cuda.Event()
    event.record()
    return StreamMark(stream_key(device), event)


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
