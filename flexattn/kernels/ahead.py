"""Compiling a problem's kernels ahead of their first launch, in worker processes.

[Note] Kernels compiled ahead. A cold first call compiles each kernel it launches where it launches
it, one after the other, in the caller's process: a compiled model's first step spent seconds
compiling its attention's four kernels (the Gluon forward, dK/dV, dQ and the preprocess) and their
launchers (docs/benchmarks_log.md, "The first run's compile time, and the op's host cost"), while
torch's compiled flex_attention had Inductor's worker processes compile its kernels side by side.

So dispatch.py (``compile_ahead``) runs a problem's launches once in *recording* mode, before they
are needed: the backward's at the forward, and, under torch.compile, the forward's and the
backward's while the graph is traced. In that mode:

* ``launch`` (kernels/launch.py) neither compiles nor runs a kernel. It asks Triton's JIT for the
  launch's specialization (``JITFunction.run(..., warmup=True)`` with a ``jit_cache_hook`` that
  notes Triton's ``specialization_data`` and declines the compile), and a worker process compiles
  it into Triton's on-disk cache (kernels/compile_worker.py). A kernel this process has compiled
  already notes nothing.
* Outputs are allocated on the meta device (``launch.empty_output``), no GPU memory and no work.
* Families keep no plan made, count no launch, and skip their rules that learn from a compiled
  kernel: the real call makes its plan as it always did.
* All of it holds for the recording thread only. Autograd runs backwards in threads of its own, and
  a launch there, or a compile Triton's hook sees from there, while another thread records, is real.

The real first launch then waits for that kernel's pending jobs, and Triton's own lookup finds the
compiled kernel on disk. Nothing here can change a result: the real launch computes its own cache
key from its real arguments, so a specialization guessed wrong (another alignment, another plan) is
a cache entry nobody reads, and that launch compiles as before. A job that fails is logged at debug
level (``FLEXATTN_DEBUG=1``) and the launch compiles itself.

[Note] Kernels answered before. A new process with the on-disk caches of earlier runs would
otherwise send every kernel to a worker again: the worker starts, imports Triton, finds the kernel
in Triton's cache and answers, while the first launch waits for it (0.58 s of a warm first call on
an H100, 2026-12-07, docs/host_path.md). So each job a worker answers without error is written down,
one digest a line, in ``FLEXATTN_CACHE_DIR/compiled_ahead``, and a job whose digest is there is not
sent. The digest covers the kernel module's file name (which holds its source's digest), the
kernel, the specialization, the target, Triton's version and its cache directory. The record can
only cost time, never change a result: the real launch computes its own cache key, and a kernel
since removed from Triton's cache is compiled by that launch, as it would be without workers.

``FLEXATTN_COMPILE_WORKERS`` sets the number of worker processes (default: half the CPUs, at most
4; 0 turns this off). Workers start on first use and end with the process.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Optional

from ..codegen.source import cache_dir, debug_enabled

__all__ = ["recording", "compiling_ahead", "record", "wait_for", "pending", "enabled", "worker_count"]

# Per thread: autograd runs backwards in its own threads, and a launch there while another thread
# records must run, not be recorded.
_state = threading.local()  # .recorded, inside compiling_ahead(): (jit_fn, specialization) of each launch
pending: dict = {}  # id(jit_fn) -> [jit_fn, its jobs' events]: kernels with a job not answered yet
_lock = threading.Lock()
_WAIT_S = 600.0  # a job not answered by then (a stuck worker) is left, and the launch compiles itself


def worker_count() -> int:
    """Worker processes to use (FLEXATTN_COMPILE_WORKERS; default half the CPUs, at most 4)."""
    value = os.environ.get("FLEXATTN_COMPILE_WORKERS")
    if value is not None and value.strip():
        try:
            return max(0, int(value))
        except ValueError:
            return 0
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def enabled() -> bool:
    """Whether launches may be compiled ahead here (workers allowed, a Triton with the hooks)."""
    if worker_count() == 0:
        return False
    try:
        from triton import knobs
    except ImportError:
        return False
    return hasattr(knobs.runtime, "jit_cache_hook")


def recording() -> bool:
    """Inside ``compiling_ahead()`` on this thread: launches are recorded, not run."""
    return getattr(_state, "recorded", None) is not None


@contextmanager
def compiling_ahead():
    """Launches inside (on this thread) are recorded, not run; on leaving, their kernels go to the workers."""
    if recording():  # nested: the outer one sends
        yield
        return
    _state.recorded = recorded = []
    try:
        yield
    finally:  # what was recorded before an error is still worth compiling
        _state.recorded = None
        for jit_fn, specialization in recorded:
            _submit(jit_fn, specialization)


def record(jit_fn, grid: tuple, args: tuple, constexprs: dict) -> None:
    """Note the specialization Triton would compile for this launch (nothing when this process has
    the kernel already). Returns None, like a launch under the interpreter."""
    from triton import knobs

    noted = []
    thread = threading.get_ident()
    previous = knobs.runtime.jit_cache_hook

    def decline(*args, **kwargs):
        if threading.get_ident() != thread:  # another thread's real compile, meanwhile: not ours
            return previous(*args, **kwargs) if previous else None
        data = (kwargs.get("compile") or {}).get("specialization_data")
        if data is not None:
            noted.append(data)
        return True  # "handled": Triton compiles nothing

    knobs.runtime.jit_cache_hook = decline
    try:
        jit_fn.run(*args, grid=grid, warmup=True, **constexprs)
    finally:
        knobs.runtime.jit_cache_hook = previous
    if noted and recording():
        _state.recorded.append((jit_fn, noted[0]))
    return None


def wait_for(jit_fn) -> None:
    """Before a real launch of ``jit_fn``: wait until the workers have answered its jobs."""
    entry = pending.get(id(jit_fn))
    if entry is None or entry[0] is not jit_fn:
        return
    for event in list(entry[1]):
        event.wait(_WAIT_S)


def _done(event: threading.Event, fn_id: Optional[int]) -> None:
    """A job answered (or lost): wake its waiters; a kernel with no job left leaves ``pending``, so
    that launches stop looking once everything sent is compiled."""
    event.set()
    with _lock:
        entry = pending.get(fn_id)
        if entry is not None and all(e.is_set() for e in entry[1]):
            del pending[fn_id]


# ------------------------------------------------------------------------------------ the workers

class _Worker:
    """One compile_worker.py process and the thread that reads its answers."""

    def __init__(self):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # a worker compiles for the GPU, whatever this process runs
        self.process = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        close_fds=True, env=env)
        self.jobs: dict = {}  # job -> (event, kernel name, id of the kernel in ``pending``, digest)
        self.reader = threading.Thread(target=self._answers, name="flexattn-compile-answers", daemon=True)
        self.reader.start()

    def send(self, job: int, event: threading.Event, description: str, fn_id: int, digest: str,
             request: tuple) -> bool:
        data = pickle.dumps(request)
        with _lock:
            self.jobs[job] = (event, description, fn_id, digest)
        try:
            self.process.stdin.write(struct.pack("<Q", len(data)) + data)
            self.process.stdin.flush()
        except (OSError, ValueError):  # the worker is gone
            with _lock:
                self.jobs.pop(job, None)
            _done(event, fn_id)
            return False
        return True

    def _answers(self) -> None:
        stream = self.process.stdout
        while True:
            head = stream.read(8)
            if len(head) < 8:
                break
            (size,) = struct.unpack("<Q", head)
            job, error, note, seconds = pickle.loads(stream.read(size))
            with _lock:
                event, description, fn_id, digest = self.jobs.pop(job, (None, "", None, None))
            if error is not None:
                _debug(f"compiling {description} ahead failed ({error}); its launch compiles it")
            else:
                launcher = f" (its launcher was not: {note})" if note else ""
                _debug(f"compiled {description} ahead in {seconds:.2f} s{launcher}")
                if digest is not None:
                    _note_answered(digest)
            if event is not None:
                _done(event, fn_id)
        with _lock:  # the worker ended: nobody waits for what it held
            jobs, self.jobs = self.jobs, {}
        for event, _, fn_id, _ in jobs.values():
            _done(event, fn_id)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass


_workers: list = []
_next_job = 0
_sent: "OrderedDict[tuple, None]" = OrderedDict()  # (module file, kernel, specialization): sent once
_SENT_KEPT = 1024


def _worker(job: int) -> Optional[_Worker]:
    count = worker_count()
    if count == 0:
        return None
    if not _workers:
        import atexit

        atexit.register(_close_workers)
    while len(_workers) < count:
        try:
            _workers.append(_Worker())
        except OSError as err:
            _debug(f"no compile worker ({err})")
            break
    _workers[:] = [w for w in _workers if w.alive()]  # a worker that died is replaced next time
    return _workers[job % len(_workers)] if _workers else None


def _close_workers() -> None:
    for worker in _workers:
        worker.close()


def _submit(jit_fn, specialization: str) -> None:
    global _next_job
    from triton import knobs
    from triton.runtime.driver import driver

    module = sys.modules.get(getattr(jit_fn, "module", "") or "")
    path = getattr(module, "__file__", None)
    if path is None:  # not a module the worker can import
        return
    sent = (path, jit_fn.fn.__name__, specialization, knobs.cache.dir)
    if sent in _sent:
        return
    _sent[sent] = None
    if len(_sent) > _SENT_KEPT:
        _sent.popitem(last=False)
    target = driver.active.get_current_target()
    digest = _job_digest(path, jit_fn.fn.__name__, specialization, target, knobs.cache.dir)
    if digest in _answered_before():  # [Note] Kernels answered before
        return
    _next_job += 1
    worker = _worker(_next_job)
    if worker is None:
        return
    event = threading.Event()
    with _lock:
        # The entry holds the kernel, so its id stays its own while the entry lives.
        pending.setdefault(id(jit_fn), [jit_fn, []])[1].append(event)
    description = jit_fn.fn.__name__
    request = (_next_job, path, module.__name__, jit_fn.fn.__name__, specialization,
               (target.backend, target.arch, target.warp_size), knobs.cache.dir, True)
    worker.send(_next_job, event, description, id(jit_fn), digest, request)


# ------------------------------------------------------------------------------------ answered before

_ANSWERED_FILE = "compiled_ahead"
_answered: Optional[set] = None  # the digests of jobs answered, here or by earlier processes


def _job_digest(path: str, kernel: str, specialization: str, target, triton_cache: str) -> str:
    import triton

    what = (os.path.basename(path), kernel, specialization, (target.backend, target.arch, target.warp_size),
            triton.__version__, triton_cache)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:32]


def _answered_before() -> set:
    """The digests in ``FLEXATTN_CACHE_DIR/compiled_ahead``, read once a process."""
    global _answered
    if _answered is None:
        try:
            _answered = set((cache_dir() / _ANSWERED_FILE).read_text().split())
        except OSError:
            _answered = set()
    return _answered


def _note_answered(digest: str) -> None:
    with _lock:
        answered = _answered_before()
        if digest in answered:
            return
        answered.add(digest)
        try:  # one short line appended: processes writing at once do not interleave within it
            with open(cache_dir() / _ANSWERED_FILE, "a") as record:
                record.write(digest + "\n")
        except OSError:
            pass


def _debug(message: str) -> None:
    if debug_enabled():
        print(f"[flexattn] {message}", file=sys.stderr)
