"""Deprecated module names of the gym (flexattn 0.1), kept for one release.

The benchmarks moved to :mod:`flexattn.bench` and the ``flexattn gym`` job with the command's other
helpers to :mod:`flexattn.cli`. ``python -m flexattn.gym`` still runs ``flexattn gym``; an old module
name (``import flexattn.gym.benchmark``, ``python -m flexattn.gym.tile_census``) still works and warns.
The repository's top-level ``gym/`` folder (the notebook and the examples) is unrelated to this one.
"""

import importlib.abc
import importlib.util
import sys

from flexattn._deprecated import warn_moved

# Old module name -> where it lives now.
MOVED = {
    "flexattn.gym.benchmark": "flexattn.bench.forward",
    "flexattn.gym.benchmark_training": "flexattn.bench.backward",
    "flexattn.gym.benchmark_decode": "flexattn.bench.decode",
    "flexattn.gym.benchmark_learnable": "flexattn.bench.learnable",
    "flexattn.gym.sweep": "flexattn.bench.sweep",
    "flexattn.gym.sweep_backward": "flexattn.bench.sweep_backward",
    "flexattn.gym.tile_census": "flexattn.bench.tile_census",
    "flexattn.gym.startup": "flexattn.bench.startup",
    "flexattn.gym.job": "flexattn.cli.gym",
    "flexattn.gym.report": "flexattn.cli.report",
    "flexattn.gym.picture": "flexattn.cli.picture",
    "flexattn.gym.kernel_source": "flexattn.cli.kernel_source",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old name at its new file: the module loads under the old name (a second copy, so
    ``python -m`` runs it as the old command did) after a DeprecationWarning."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warn_moved(fullname, new)
        return importlib.util.spec_from_file_location(fullname, importlib.util.find_spec(new).origin)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
