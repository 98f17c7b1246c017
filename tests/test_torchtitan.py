"""flexattn.integrations.torchtitan (issue 54): torchtitan's models on flexattn, its context
parallelism on flexattn.distributed.

Training runs in subprocesses, through tests/torchtitan_run.py, on CPU ranks (gloo): torchtitan's
llama3 debug model (2 of its 6 layers, 256 tokens of packed documents, 64-token mask blocks),
trained 8 steps by torchtitan's own Trainer from the same initial weights,

* on one rank: with flexattn (``use_flexattn``), and with the dense reference (torch's SDPA given
  the BlockMask's mask written out in full) in float32 and, as the golden run, in float64;
* on two ranks with ``context_parallel_degree=2``: with flexattn, whose ring runs the attention;
* and the first batch's loss with torchtitan's own FlexAttention (torch's compiled
  flex_attention, whose backward torch refuses on a CPU: it cannot train there).

Both spawns start together: about a minute on 2 busy cores (52 s of CPU, compiles included). The
config-level tests run in this process. Needs torchtitan 0.3 (the ``test`` extra, Python 3.11 or
newer); skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("needs torchtitan 0.3 (pip install 'flexattn[torchtitan]', Python 3.11+)", allow_module_level=True)

from torch.nn.attention.flex_attention import AuxRequest  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models.common.decoder_sharding import set_gqa_inner_attention_local_map  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel, llama3_debugmodel_varlen_attn  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from numerics import rel_err  # noqa: E402

import flexattn.integrations.torchtitan as titan  # noqa: E402
from flexattn.errors import InvalidInputError  # noqa: E402
from flexattn.reference import reference_attention  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "torchtitan_run.py"
STEPS, LAYERS = 8, 2
TRAINING = ["--cpu", "--steps", str(STEPS), "--layers", str(LAYERS), "--seq-len", "256", "--batch", "2",
            "--block-size", "64"]


# ------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The loss curves of both spawns (one rank; two ranks with context parallelism 2), started together."""
    out = tmp_path_factory.mktemp("torchtitan")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    commands = {
        "one_rank": [*TRAINING, "--attention", "torchtitan", "dense64", "dense", "flexattn", "--no-autotune"],
        # torchtitan 0.3's default spmd_backend, "spmd_types", needs a newer torch's FSDP on more than
        # one rank (torch 2.13's fully_shard wants DTensor parameters); "full_dtensor" runs on it.
        "two_ranks": [*TRAINING, "--attention", "flexattn", "--world", "2", "--cp", "2", "--backend", "full_dtensor",
                      "--schedule", "ring"],
    }
    procs = {name: subprocess.Popen([sys.executable, str(RUN), *args, "--out", str(out / f"{name}.json")], env=env,
                                    cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, args in commands.items()}
    results = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} failed:\n{log[-6000:]}"
        results[name] = json.loads((out / f"{name}.json").read_text())
    return results


def _distance(curve, golden) -> float:
    return max(abs(a - b) for a, b in zip(curve, golden, strict=True))


def _budget(curves) -> float:
    """What float32 costs anyway, against the golden float64 run: the float32 dense run's distance
    from it, twice over (flash-attention's rule), plus 8 float32 spacings of the first loss for the
    rounding of the loss itself (near 8, losses are multiples of 9.5e-7). A wrong gradient shows
    at once: the recomputation bug fixed with this file put the curve 1.5e-4 away by step 8."""
    golden = curves["dense64"]
    return 2 * _distance(curves["dense"], golden) + 8 * torch.finfo(torch.float32).eps * abs(golden[0])


def test_one_rank_trains_like_the_dense_reference(runs):
    curves = runs["one_rank"]["losses"]["float32"]
    assert len(curves["flexattn"]) == STEPS
    golden = curves["dense64"]
    assert min(golden[STEPS // 2:]) < golden[0] - 0.05, "the model learns nothing: a weak comparison"
    distance, budget = _distance(curves["flexattn"], curves["dense64"]), _budget(curves)
    assert distance <= budget, f"flexattn's loss curve is {distance:.3g} from the golden run (budget {budget:.3g})"


def test_first_loss_is_torchtitans_own_flex_attention(runs):
    curves = runs["one_rank"]["losses"]["float32"]
    distance = abs(curves["flexattn"][0] - curves["torchtitan"][0])
    assert distance <= _budget(curves), f"first loss {curves['flexattn'][0]} vs torchtitan's {curves['torchtitan'][0]}"


def test_two_ranks_with_context_parallelism_train_like_one(runs):
    two = runs["two_ranks"]
    curves = runs["one_rank"]["losses"]["float32"]
    distance, budget = _distance(two["losses"]["float32"]["flexattn"], curves["dense64"]), _budget(curves)
    assert distance <= budget, f"context parallelism's curve: {distance:.3g} from the golden run (budget {budget:.3g})"
    # Rank 0's attention ran on flexattn.distributed's ring, every layer: the forward, and again when
    # torchtitan's selective activation checkpointing recomputes it for the backward.
    calls = two["context_parallel_calls"]
    assert len(calls) == 2 * LAYERS * STEPS
    assert {schedule for schedule, *_ in calls} == {"ring"}  # (schedule, steps, head chunks)


# ------------------------------------------------------------------------------------ configs


def _inner_attentions(config):
    return [attention for _, attention, _, _ in config.model_spec.model.traverse(FlexAttention.Config)]


def test_use_flexattn_swaps_every_attention_and_the_trainer():
    stock = llama3_debugmodel()
    stock.model_spec.model.layers[0].attention.inner_attention.kernel_options = {"BLOCK_M": 64}
    config = titan.use_flexattn(stock, cp_balance="zigzag")
    attentions = _inner_attentions(config)
    assert len(attentions) == 6 and all(type(a) is titan.FlexattnAttention.Config for a in attentions)
    assert attentions[0].kernel_options == {"BLOCK_M": 64} and attentions[0].cp_balance == "zigzag"
    assert attentions[0].block_size == FlexAttention.Config().block_size
    assert type(config) is titan.FlexattnTrainer.Config and type(config.validator) is titan.FlexattnValidator.Config
    assert config.training == stock.training and config.optimizer == stock.optimizer


def test_torchtitans_command_line_finds_its_configs_through_the_module():
    config = ConfigManager().parse_args(["--module", "flexattn.integrations.torchtitan",
                                         "--config", "llama3_debugmodel", "--parallelism.context_parallel_degree", "2"])
    assert type(config) is titan.FlexattnTrainer.Config
    assert config.parallelism.context_parallel_degree == 2
    assert all(type(a) is titan.FlexattnAttention.Config for a in _inner_attentions(config))
    with pytest.raises(ValueError, match="llama3_nosuchmodel"):
        ConfigManager().parse_args(["--module", "flexattn.integrations.torchtitan", "--config", "llama3_nosuchmodel"])


def test_torchtitans_override_swaps_the_attention_alone():
    config = llama3_debugmodel()
    apply_overrides(OverrideConfig(imports=[("flexattn.integrations.torchtitan.flexattn_attention",
                                             {"cp_schedule": "ring"})]), config)
    attentions = _inner_attentions(config)
    assert all(type(a) is titan.FlexattnAttention.Config and a.cp_schedule == "ring" for a in attentions)
    assert type(config) is Trainer.Config


def test_context_parallelism_keeps_key_and_value_shards():
    # torchtitan's sharding config all-gathers K and V over the context-parallel ranks at the inner
    # attention's boundary; flexattn's ring brings each rank the shards it needs instead.
    config = titan.FlexattnAttention.Config()
    set_gqa_inner_attention_local_map(config)
    theirs = config.sharding_config
    assert theirs.in_dst_shardings["k_BLNH"] != theirs.in_src_shardings["k_BLNH"]
    ours = titan._keeping_kv_shards(theirs)
    for name in ("k_BLNH", "v_BLNH"):
        assert ours.in_dst_shardings[name] == ours.in_src_shardings[name] == theirs.in_src_shardings[name]
    assert ours.in_dst_shardings["q_BLNH"] == theirs.in_dst_shardings["q_BLNH"]
    sources = tuple(theirs.in_src_shardings[name] for name in ("q_BLNH", "k_BLNH", "v_BLNH"))
    assert ours.local_map.in_grad_placements == sources  # each gradient keeps its input's placement


def test_attention_module_computes_torchs_flex_attention(one_thread):
    # The model's BlockMask (torch's), a score_mod reading a tensor, grouped-query attention, an
    # out_transform of the LSE and torchtitan's flex_flash kernel_options, as torchtitan passes them.
    B, Hq, Hkv, L, E = 2, 4, 2, 200, 16
    slopes = torch.rand(Hq)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def sink(out, lse):  # [B, L, H, D] and [B, L, H]
        return out * torch.sigmoid(lse).unsqueeze(-1)

    block_mask = torch_create_block_mask(causal, B, None, L, L, device="cpu", BLOCK_SIZE=64)
    q, k, v = (torch.randn(B, L, h, E) for h in (Hq, Hkv, Hkv))
    module = titan.FlexattnAttention.Config(kernel_options={"BACKEND": "FLASH"}).build()
    got = module(q, k, v, attention_masks=block_mask, score_mod=alibi, scale=0.3, enable_gqa=True, out_transform=sink)

    def attention(q, k, v, run):
        out, aux = run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        lse = aux.lse if hasattr(aux, "lse") else aux
        return sink(out.transpose(1, 2), lse.transpose(1, 2))

    torch_run = attention(q, k, v, lambda q, k, v: torch_flex_attention(
        q, k, v, score_mod=alibi, block_mask=block_mask, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True)))
    golden = attention(*(t.double() for t in (q, k, v)), lambda q, k, v: reference_attention(
        q, k, v, score_mod=alibi, mask_mod=causal, scale=0.3, enable_gqa=True)[:2])
    # flash-attention's rule: at most twice torch's own float32 error, plus a float32 floor.
    assert rel_err(got, golden) <= 2 * rel_err(torch_run, golden) + 1e-6


# ------------------------------------------------------------------------------------ errors


def test_bad_configs_say_what_to_change():
    with pytest.raises(InvalidInputError, match="cp_balance must be one of"):
        titan.FlexattnAttention.Config(cp_balance="ptrr")
    with pytest.raises(InvalidInputError, match="no FlexAttention to swap"):
        titan.use_flexattn(llama3_debugmodel_varlen_attn())
    for change, match in [(lambda c: setattr(c.parallelism, "spmd_backend", "partial_dtensor"), "spmd_backend"),
                          (lambda c: setattr(c.compile, "enable", True), "torch.compile"),
                          (lambda c: setattr(c.training, "disable_cuda_graphs", False), "disable_cuda_graphs")]:
        config = titan.use_flexattn(llama3_debugmodel())
        config.parallelism.context_parallel_degree = 2
        config.training.disable_cuda_graphs = True
        change(config)
        with pytest.raises(InvalidInputError, match=match):
            config.build()  # before any process group or device is touched


def test_a_batch_sharded_by_torchtitan_is_refused(one_thread):
    # torchtitan's own trainer shards the batch and the BlockMask itself under context parallelism;
    # flexattn's shards and ring would then compute the wrong thing, so the module says so.
    module = titan.FlexattnAttention.Config().build()
    module.context_parallel = True  # what parallelize sets on a context-parallel mesh
    q = torch.randn(1, 128, 2, 16)
    block_mask = torch_create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, None, 128, 128, device="cpu")
    with pytest.raises(InvalidInputError, match="use_flexattn"):
        module(q, q, q, attention_masks=block_mask)
