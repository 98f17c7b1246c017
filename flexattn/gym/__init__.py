"""The gym, installed with flexattn: the main job (``flexattn gym``, ``python -m flexattn.gym``), the
paper benchmarks (``flexattn bench``; ``python -m flexattn.gym.benchmark``, ``.benchmark_decode``), the
launch-config sweeps (``.sweep``, ``.sweep_backward``) and the start-up timing (``.startup``).

The repository's ``gym/`` folder keeps the notebook and the examples; these modules live here so the
command works from any directory after ``pip install``.
"""
