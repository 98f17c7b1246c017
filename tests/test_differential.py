"""Differential test: every variant we know of, one process, a shuffled order, every backend.

Each step builds a variant from its factory (the catalogue in flexattn.variants, attention-gym's masks and mods,
torch's own ``and_masks`` / ``or_masks`` / ``noop_mask``), builds a fresh BlockMask, runs
``flex_attention`` through each backend and compares with the float64 reference; then it drops the
mods and the BlockMask and collects garbage, so the next step's objects can reuse their ``id()``s.
Factories are called again with other parameters (window 32 then 64, prefix 16 then 64, other
tensors), so different compositions share code objects, and every cache in the package sees the same
code come back with different contents. What a cache key misses shows up here as a wrong number.

Shapes are small (L, S in 64..160, d=16, B in 1..2, H=2) since the Triton backend runs in Triton's
interpreter on a CPU; on a GPU the same steps run through the compiled kernels.
``FLEXATTN_DIFF_SEED=N`` replays the steps in another order.
"""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
# attention-gym comes with the test extra (CI installs it); a machine without it, such as the GPU
# box, skips this module instead of failing to collect it.
pytest.importorskip("attn_gym", reason="attention-gym (attn-gym, in the test extra) is not installed")
from attn_gym import masks as ag_masks  # noqa: E402
from attn_gym import mods as ag_mods  # noqa: E402
from attn_gym.masks.document_mask import length_to_offsets  # noqa: E402
from numerics import rel_err
from torch.nn.attention.flex_attention import and_masks as torch_and_masks
from torch.nn.attention.flex_attention import noop_mask as torch_noop_mask
from torch.nn.attention.flex_attention import or_masks as torch_or_masks

from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.reference import reference_attention
from flexattn.variants import CATALOGUE, split_lengths

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On a CPU the Triton backend needs the interpreter (tests/conftest.py sets it when there is no GPU).
BACKENDS = ["PYTORCH"]
if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    BACKENDS.append("TRITON")
SEED = int(os.environ.get("FLEXATTN_DIFF_SEED", "8"))
TOLERANCE = 2e-5  # float32 inputs against the float64 reference, norm-wise
HEADS, HEAD_DIM = 2, 16


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    L: int  # Q_LEN
    S: int  # KV_LEN


@dataclass(frozen=True)
class Case:
    """A variant factory: ``build(shape, param) -> (score_mod, mask_mod)``, called once per param."""

    name: str
    build: Callable[[Shape, Any], tuple]
    params: tuple = (None,)
    square: bool = False  # the variant describes one packed sequence: Q_LEN == KV_LEN


def _offsets(total: int, seed: int) -> torch.Tensor:
    return length_to_offsets(split_lengths(total, 3, seed), DEVICE)


def _prefix(length: int):
    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < length

    return prefix


def _window(size: int):
    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= size

    return window


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _catalogue_case(name: str) -> Case:
    def build(shape: Shape, _):
        return CATALOGUE[name].build(shape.B, shape.H, shape.L, shape.S, DEVICE)

    return Case(f"catalogue/{name}", build, square=CATALOGUE[name].square_only)


def _graphormer_spatial(shape: Shape, seed: int):
    gen = _seeded(seed)
    buckets = 6
    bias = torch.randn(shape.H, buckets, generator=gen).to(DEVICE)
    distances = torch.randint(0, buckets, (shape.B, shape.L, shape.S), generator=gen).to(DEVICE)
    return ag_mods.generate_graphormer_spatial_bias(bias, distances), None


def _graphormer_edge(shape: Shape, seed: int):
    gen = _seeded(seed)
    path_len, edge_types = 3, 4
    bias = torch.randn(shape.H, path_len, edge_types, generator=gen).to(DEVICE)
    types = torch.randint(0, edge_types, (shape.B, shape.L, shape.S, path_len), generator=gen).to(DEVICE)
    lengths = torch.randint(0, path_len + 1, (shape.B, shape.L, shape.S), generator=gen).to(DEVICE)
    return ag_mods.generate_graphormer_edge_bias(bias, types, lengths), None


def _mla_rope(shape: Shape, scale: float):
    query_rope = torch.randn(shape.B, shape.H, shape.L, 8, device=DEVICE)
    key_rope = torch.randn(shape.B, 1, shape.S, 8, device=DEVICE)
    return ag_mods.generate_mla_rope_score_mod(query_rope, key_rope, shape.H, scale), None


def _is_global(shape: Shape, stride: int) -> torch.Tensor:
    return torch.arange(max(shape.L, shape.S), device=DEVICE) % stride == 0


CASES = [_catalogue_case(name) for name in CATALOGUE] + [
    # attention-gym's masks (the first three are built with torch's and_masks / or_masks)
    Case("attn_gym/causal", lambda s, _: (None, ag_masks.causal_mask)),
    Case("attn_gym/sliding_window", lambda s, w: (None, ag_masks.generate_sliding_window(w)), (32, 64)),
    Case("attn_gym/prefix_lm", lambda s, p: (None, ag_masks.generate_prefix_lm_mask(p)), (16, 64)),
    Case("attn_gym/global_sliding_window",
         lambda s, p: (None, ag_masks.generate_global_sliding_window(p[0], _is_global(s, p[1]))), ((16, 37), (32, 23))),
    Case("attn_gym/document_causal",
         lambda s, seed: (None, ag_masks.generate_doc_mask_mod(ag_masks.causal_mask, _offsets(s.L, seed))), (0, 1),
         square=True),
    Case("attn_gym/document_noop",
         lambda s, seed: (None, ag_masks.generate_doc_mask_mod(torch_noop_mask, _offsets(s.L, seed))), (2, 3),
         square=True),
    Case("attn_gym/packed_causal_document",
         lambda s, seed: (None, ag_masks.generate_packed_causal_doc_mask_mod(_offsets(s.L, seed))), (4, 5),
         square=True),
    Case("attn_gym/dilated_sliding_window",
         lambda s, p: (None, ag_masks.generate_dilated_sliding_window(*p)), ((24, 3), (40, 2))),
    Case("attn_gym/natten", lambda s, k: (None, ag_masks.generate_natten(16, 10, *k)), ((5, 3), (7, 5))),
    Case("attn_gym/tiled_natten",
         lambda s, k: (None, ag_masks.generate_tiled_natten(16, 12, *k, 4, 4)), ((5, 3), (7, 5))),
    Case("attn_gym/morton_natten", lambda s, k: (None, ag_masks.generate_morton_natten(16, 16, *k)), ((5, 3), (7, 5))),
    Case("attn_gym/block_diffusion",
         lambda s, block: (None, ag_masks.generate_block_diffusion_mask(s.L // 2, block)), (16, 8), square=True),
    Case("attn_gym/shared_prefix",
         lambda s, seed: (None, ag_masks.generate_shared_prefix_mask_mod(
             length_to_offsets(split_lengths(s.L, 4, seed), DEVICE), torch.tensor([0, 0, 0, 3], device=DEVICE))),
         (6, 7), square=True),
    # attention-gym's score mods
    Case("attn_gym/alibi+causal", lambda s, _: (ag_mods.generate_alibi_bias(s.H), ag_masks.causal_mask)),
    Case("attn_gym/tanh_softcap", lambda s, cap: (ag_mods.generate_tanh_softcap(cap), None), (5, 20)),
    Case("attn_gym/sandwich", lambda s, d: (ag_mods.generate_sandwich_bias(s.H, max(s.L, s.S), d, DEVICE), None),
         (16, 32)),
    Case("attn_gym/gelu_activation",
         lambda s, offset: (ag_mods.generate_activation_score_mod(F.gelu, offset), None), (1.0, 2.0)),
    Case("attn_gym/graphormer_spatial", _graphormer_spatial, (0, 1)),
    Case("attn_gym/graphormer_edge", _graphormer_edge, (0, 1)),
    Case("attn_gym/mla_rope", _mla_rope, (0.5, 2.0)),
    # torch's own combinators, written here as a user would
    Case("torch/or_masks(prefix, causal)",
         lambda s, p: (None, torch_or_masks(_prefix(p), ag_masks.causal_mask)), (16, 64)),
    Case("torch/and_masks(causal, window)",
         lambda s, w: (None, torch_and_masks(ag_masks.causal_mask, _window(w))), (32, 64)),
    Case("torch/noop_mask", lambda s, _: (None, torch_noop_mask)),
]


def _steps(rng: random.Random) -> list[tuple[Case, Any, Shape, Any]]:
    """Every (case, param) once, in a shuffled order, each with its own shape and block size."""
    steps = [(case, param) for case in CASES for param in case.params]
    rng.shuffle(steps)
    out = []
    for case, param in steps:
        L = rng.choice([64, 96, 128, 160])
        S = L if case.square else rng.choice([64, 96, 128, 160])
        out.append((case, param, Shape(rng.choice([1, 2]), HEADS, L, S), rng.choice([32, 64])))
    return out


def _describe(step: int, case: Case, param, shape: Shape, block: int, backend: str) -> str:
    param_text = "" if param is None else f"({param})"
    return (f"step {step}: {case.name}{param_text} B={shape.B} H={shape.H} L={shape.L} S={shape.S} "
            f"BLOCK_SIZE={block} backend={backend}")


@pytest.mark.slow  # about 30 s on 2 CPU cores (the interpreter); CI runs it
def test_every_variant_in_one_process_against_the_reference(one_thread, collect_new_objects_only):
    rng = random.Random(SEED)
    failures = []
    for step, (case, param, shape, block) in enumerate(_steps(rng)):
        score_mod, mask_mod = case.build(shape, param)
        q, k, v = (torch.randn(shape.B, shape.H, n, HEAD_DIM, device=DEVICE) for n in (shape.L, shape.S, shape.S))
        ref_out, ref_lse, _ = reference_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                                  mask_mod=mask_mod)
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, shape.B, shape.H, shape.L, shape.S, device=DEVICE,
                                           BLOCK_SIZE=block)
        for backend in BACKENDS:
            where = _describe(step, case, param, shape, block, backend)
            try:
                out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                          kernel_options={"BACKEND": backend}, return_aux=AuxRequest(lse=True))
                errors = (rel_err(out, ref_out), rel_err(aux.lse, ref_lse))
            except Exception as err:  # every step runs; the report lists them all
                failures.append(f"{where}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
                continue
            if not max(errors) < TOLERANCE:
                failures.append(f"{where}: relative error out {errors[0]:.2e}, lse {errors[1]:.2e}")
        # Free this step's objects before the next one is built, so their ids can come back.
        del score_mod, mask_mod, block_mask, q, k, v
        gc.collect()
    assert not failures, (f"{len(failures)} failing step(s) (seed {SEED}; FLEXATTN_DIFF_SEED replays another "
                          f"order):\n" + "\n".join(failures))


@pytest.mark.parametrize("name", ["attn_gym/sliding_window", "torch/or_masks(prefix, causal)"])
def test_same_factory_other_parameter_on_the_same_mask_backend(name, one_thread):
    # The smallest form of the collision the long test looks for: one factory, two parameters, one
    # after the other, each checked against the reference (a cache that keys the composition by the
    # library function's name alone gives the second call the first call's mask_mod).
    case = next(c for c in CASES if c.name == name)
    shape = Shape(1, HEADS, 128, 128)
    q, k, v = (torch.randn(1, HEADS, 128, HEAD_DIM, device=DEVICE) for _ in range(3))
    for backend in BACKENDS:
        for param in case.params:
            _, mask_mod = case.build(shape, param)
            block_mask = create_block_mask(mask_mod, 1, HEADS, 128, 128, device=DEVICE, BLOCK_SIZE=32)
            out = flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
            ref, _, _ = reference_attention(q.double(), k.double(), v.double(), mask_mod=mask_mod)
            assert rel_err(out, ref) < TOLERANCE, f"{name}({param}) on {backend}"


def _block_pattern_mask(pattern: torch.Tensor, block: int):
    """Keeps the (query block, key block) pairs that ``pattern`` marks, and within them a pattern
    that leaves every kept block partial (so the kernel walks them with the mask_mod)."""

    def block_pattern(b, h, q_idx, kv_idx):
        return pattern[q_idx // block, kv_idx // block] & ((q_idx + 2 * kv_idx) % 5 != 0)

    return block_pattern


def _recycled_ids_for_block_masks(monkeypatch) -> None:
    """Make the worst case of a freed BlockMask's id() coming back happen on every step: inside
    flexattn's modules, ``id()`` of any BlockMask answers one number (only one is alive at a time
    in the loop below, so CPython could do the same). Other objects keep their real ids."""
    import sys

    import flexattn

    def recycled_id(obj):
        return 1 if isinstance(obj, flexattn.BlockMask) else id(obj)

    # A module-level name shadows the builtin inside that module, in every module of the package.
    for name, module in list(sys.modules.items()):
        if name == "flexattn" or name.startswith("flexattn."):
            monkeypatch.setattr(module, "id", recycled_id, raising=False)


@pytest.mark.parametrize("ids", ["as_cpython_gives_them", "always_recycled"])
def test_masks_rebuilt_every_step_like_a_training_loop(ids, monkeypatch, one_thread, collect_new_objects_only):
    # One mask_mod (one code object, one kernel) whose block pattern changes every step, as a
    # training loop that builds a BlockMask per batch does: consecutive blocks per row (causal) in
    # even steps, gaps in odd ones. The old BlockMask is freed before the new one is built, so the
    # new one can get its id(); whatever was derived from the old mask must not be reused.
    if ids == "always_recycled":
        _recycled_ids_for_block_masks(monkeypatch)
    L = S = 128
    block = 32
    n = L // block
    causal_blocks = torch.ones(n, n, dtype=torch.bool).tril()
    gapped_blocks = causal_blocks & (torch.arange(n)[None, :] % 2 == 0) | torch.eye(n, dtype=torch.bool)
    q, k, v = (torch.randn(1, HEADS, L, HEAD_DIM, device=DEVICE) for _ in range(3))
    failures = []
    for step in range(6):
        pattern = (causal_blocks if step % 2 == 0 else gapped_blocks).to(DEVICE)
        mask_mod = _block_pattern_mask(pattern, block)
        block_mask = create_block_mask(mask_mod, 1, HEADS, L, S, device=DEVICE, BLOCK_SIZE=block)
        ref, _, _ = reference_attention(q.double(), k.double(), v.double(), mask_mod=mask_mod)
        for backend in BACKENDS:
            out = flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
            err = rel_err(out, ref)
            if not err < TOLERANCE:
                failures.append(f"step {step} ({'gapped' if step % 2 else 'causal'} blocks) on {backend}: "
                                f"relative error {err:.2e}")
        del mask_mod, block_mask, pattern
        gc.collect()
    assert not failures, "\n".join(failures)
