"""Codegen: plain values -> kernel source (stage 3: trace -> lowering -> codegen -> kernels).

``params`` declares each kernel's parameters once; ``source`` renders a family's Jinja template
(flexattn/templates/) with the lowered mods and those parameters, writes the source under a
content-addressed name and imports it.
"""

from .source import FAMILIES, KernelSpec, cache_dir, counts, debug_enabled, kernel_index, load_kernel_module, render

__all__ = ["FAMILIES", "KernelSpec", "cache_dir", "counts", "debug_enabled", "kernel_index", "load_kernel_module",
           "render"]
