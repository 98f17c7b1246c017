"""flex_attention inside ``torch.compile``: the custom ops Dynamo, AOTAutograd and Inductor see, and
the part of a call that Dynamo traces in place of the eager path. Its modules:

* ``probe.py``: what a mod reads, found by running it (the probe), and mods made in the graph
  (``described``, ``rebuilt``);
* ``registry.py``: the traced mods under their content key (``register_call``), found again and
  checked at each call of the ops (``mod_inputs``);
* ``ops.py``: the two custom ops, their bodies, fake implementations and the forward's autograd;
* ``kept.py``: what a compiled call's mask derives, kept per table for the next calls;
* ``warm.py``: the warm calls, which repeat the first call's launch of a problem.

[Note] flex_attention under torch.compile
The eager path traces a mod by walking the callable (trace/), which Dynamo cannot follow: it broke a
compiled layer into 19 graphs. Under Dynamo a call takes another route, in three parts:

1. **The mods, traced outside the graph.** ``register_call`` (called by api.py from a function marked
   as ``torch.compiler.assume_constant_result`` marks, so Dynamo runs it as plain Python on the real
   callables and keeps only its result) traces both mods with flexattn's own tracer, registers the
   TracedMods under a key made from their content, and returns that key: a string constant in the
   graph. The same mods in another process give the same key, so Inductor's caches stay valid (the
   key is registered when Dynamo traces the call, so a graph needs Dynamo to have run in the process:
   torch.export's programs, loaded on their own, do not carry the mods). A mod made inside the
   compiled function by a ``mod_factory`` reaches it as the factory call (``described``), made again
   on zero tensors of the same shapes (``rebuilt``).
2. **What the mods read, found by Dynamo.** ``probe`` runs the mod once on empty probe tensors
   under a TorchFunctionMode that notes every tensor and Python number reaching a torch function
   that the mod did not make itself. Dynamo inlines that run like any user code: it guards everything the mod
   reads (a global it calls, the code of a closure, a number it specializes) and turns each tensor
   the mod reads into a graph value, an input or an intermediate, whose gradient flows, and each
   number its torch calls take into a value the op receives at run time (``score_numbers``,
   ``mask_numbers``). So a new closure of the same code over new tensors, new contents or new
   numbers reuses the graph; what Dynamo guards on recompiles (docs/compile.md's table). ``register_call`` runs the same probe eagerly on the real callable and
   matches what it notes, by identity, with the TracedMod's captured inputs: Python runs the mod the
   same way in both, so the i-th tensor noted under Dynamo is the i-th noted eagerly. The probes are
   empty, so the probe's ops read nothing at run time (and are dead code the compiler drops).
3. **One custom op per pass.** ``flexattn::flex_attention`` and ``flexattn::flex_attention_backward``
   (defined with ``torch.library``, [Note] The ops' registration) take the query, key, value, the BlockMask's tables, the captured
   tensors and the key. Their fake implementations give the real outputs' shapes, dtypes and
   strides; the forward's autograd formula calls the backward op. Inductor calls them as extern
   kernels, and CUDA graphs capture their launches.

Inside the op the tables are trusted (``BlockMask.from_launch_tables``): a BlockMask's own tables are
ascending and in range by construction (create_block_mask, from_kv_blocks, decode_block_mask,
PagedAttention), and checking them would read them back to the host on every call, which neither a
compiled step nor a CUDA graph can afford. Their row statistics are those checked once for the first
mask of each shape ([Note] What a compiled call's mask derives, kept), else fixed (no consecutive-block
fast path), as for decoding masks ([Note] Tables in range by construction in masks/block_mask.py).

A closure created inside the compiled function over a tensor, not by a mod_factory, has no Python
object outside the graph to trace: Dynamo refuses it at compile time ("failed to convert closure
cell"); docs/compile.md says to define it outside or make it with a factory. Inside activation
checkpointing that Dynamo traces, entering the probe's mode counts as a side effect to replay;
docs/compile.md gives the setting that lets it pass.
"""

from .ops import BackwardInputs, ForwardInputs, flex_attention_backward_op, flex_attention_op
from .probe import described, probe
from .registry import mod_inputs, register_call, registered_call

__all__ = ["register_call", "probe", "described", "flex_attention_op", "flex_attention_backward_op",
           "registered_call", "mod_inputs", "ForwardInputs", "BackwardInputs"]
