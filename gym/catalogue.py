"""The variant catalogue moved into the package: ``flexattn.variants`` (kept here for old imports)."""

from flexattn.variants import *  # noqa: F401,F403
from flexattn.variants import CATALOGUE, Variant  # noqa: F401
