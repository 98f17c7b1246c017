"""The lab: the measurements behind flexattn's defaults and docs, kept out of the installed package.

Users' benchmarks ship with flexattn (``flexattn bench``, flexattn/bench/). This folder holds the
equipment the project's own work uses, run from the checkout's root as ``python -m benchmarks.NAME``
(``--help`` lists each one's options; most need a CUDA GPU):

* what a change left alone: ``same_kernels`` (the rendered kernels, their compiled code, their
  outputs' bits and their times, old tree against new; run it as a file, ``python
  benchmarks/same_kernels.py``, so that PYTHONPATH picks the flexattn it measures) and
  ``triton_release`` (the default kernels under another Triton);
* how defaults were chosen: ``sweep`` and ``sweep_backward`` (launch configurations),
  ``tile_census`` (what the compiler made of every default kernel), ``launch_order`` (the grid's
  order against the launch rule's);
* one question each: ``learnable`` (the backward of variants with learnable tables), ``host_proxy``
  (a warm call's host path on a CPU, launches stubbed; on a GPU, ``flexattn bench --mode host``
  measures it, with the first call, and ``host_profile`` profiles both), ``model_profile (where a compiled model step's time
  goes), ``number_inputs`` (a mod's numbers as kernel arguments against literals);
* context parallelism: ``context_parallel`` (the ring on one GPU with streams for ranks, and the
  ring's cost model at scale), ``context_parallel_gpus`` (real ranks, one process per GPU, beside
  torch's context parallelism, which ``torch_context_parallel`` sets up);
* ``targets``: one issue's speed targets, checked against a run of ``flexattn bench --mode fwd|bwd``
  (``--run``) or against stored runs.

``device_session.sh STAGE`` runs, in one call of the lent GPU, what the open issues still need
measured there (the compile tests, the GPU suite in two halves, the host bench and its profiles,
context parallelism's merge and memory, numbers against literals).

Results with their device, versions and commands: docs/benchmarks.md (the current numbers) and
docs/benchmarks_log.md (the dated log). flexattn never imports this folder (tests/test_structure.py).
"""
