"""Shared test set-up: import path, the Triton interpreter on CPU machines, GPU markers."""

import gc
import os
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # so tests import this checkout's flexattn, not an installed copy

# Kernels' outputs start as NaN in tests, so an element a kernel never writes cannot pass.
os.environ.setdefault("FLEXATTN_POISON_OUTPUTS", "1")

# The tests' kernels, kernel index and tuned configurations go to a directory of this session: a
# developer's own cache (or one an earlier run left with a test's stand-in lowering in it) must not
# decide what a test sees, and the tests must not fill it.
if "FLEXATTN_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="flexattn-tests-")
    os.environ["FLEXATTN_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Without a GPU every generated Triton kernel runs in Triton's interpreter. The variable must be
    # set before kernels are imported: @triton.jit reads it when a kernel module is loaded.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One of pytest-xdist's workers (`-n N`): the workers share the cores, so each takes its share of
    # torch's threads (a second thread that spin-waits while the other worker holds the core is slower
    # than none: see one_thread below).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # With `-n N` (pytest-xdist), whole files go to one worker each: several files start ranks or
    # training runs once in a module-scoped fixture, which per-test distribution would start once per
    # worker. An explicit --dist other than the default "load" is kept.
    if config.getoption("dist") == "load":
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_thread():
    # Small CPU shapes: on a shared 2-core machine a second OpenMP thread spin-waits while another
    # process holds the other core, making small ops several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def collect_new_objects_only():
    """For tests that call gc.collect() in a loop: every object alive when the test starts is set
    aside (gc.freeze), so each collection walks only what the test made since, all of which it still
    collects. Late in a full run the session's heap made each full collection take about half a
    second, and the differential sweep (one per step) five times slower; the set-aside objects go
    back (gc.unfreeze) at the end."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: fresh random inputs, never zeros.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
