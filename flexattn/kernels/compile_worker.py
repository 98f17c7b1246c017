"""A process that compiles kernels into Triton's cache for kernels/ahead.py, and nothing else.

Started as a script (``python .../compile_worker.py``), not as a module of the package, so that it
imports Triton and the generated kernel modules only: no torch, no flexattn (a second or two saved
per worker). It reads requests from stdin and answers on stdout, one pickled tuple a message, each
preceded by its length in 8 bytes:

    request: (job, module_path, module_name, kernel_name, specialization, target, cache_dir, launcher)
    answer:  (job, error or None, note on the launcher or None, seconds)

``specialization`` is the JSON Triton's JIT writes for a launch (``specialization_data``, the form
``JITFunction.preload`` reads); ``target`` is ``(backend, arch, warp_size)`` of the parent's GPU;
``cache_dir`` the parent's Triton cache directory at the time of the request. The kernel module is
imported under the parent's module name from the same file, so the kernel hashes to the same cache
key. ``launcher``: also build the kernel's host launcher (a C extension compiled once per signature
and cached by Triton too), where this Triton builds one.
"""

import importlib.util
import os
import pickle
import struct
import sys
import time


class _CompileOnly:
    """The driver Triton's preload sees here: the parent's target, and no GPU touched."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_target(self):
        return self.target


def _read(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def _write(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _module(path: str, name: str, loaded: dict):
    module = loaded.get(path)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loaded[path] = module
    return module


def _build_launcher(kernel) -> None:
    try:
        from triton.backends.nvidia import driver as cuda_driver
    except ImportError:  # another backend
        return
    if hasattr(cuda_driver, "make_launcher"):  # Triton 3.6: a C launcher per signature (later: one for all)
        cuda_driver.CudaLauncher(kernel.src, kernel.metadata)


def _last_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    # The answers get a descriptor of their own; descriptor 1 becomes stderr, so that whatever a
    # compiler prints, from Python or from C, cannot corrupt them.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    loaded: dict = {}
    while True:
        request = _read(stdin)
        if request is None:
            return 0
        job, path, module_name, kernel_name, specialization, target, cache_dir, launcher = request
        start = time.perf_counter()
        error = note = None
        try:
            triton.knobs.cache.dir = cache_dir
            driver.set_active(_CompileOnly(GPUTarget(*target)))
            kernel = getattr(_module(path, module_name, loaded), kernel_name).preload(specialization)
        except BaseException as err:  # reported to the parent, which then compiles it itself
            error, kernel = _last_line(err), None
        if launcher and kernel is not None:
            try:
                _build_launcher(kernel)
            except BaseException as err:  # the parent builds it at the first launch
                note = _last_line(err)
        _write(stdout, (job, error, note, time.perf_counter() - start))


if __name__ == "__main__":
    sys.exit(main())
