"""The run of context parallelism on several GPUs (benchmarks/context_parallel_gpus.py), small.

``--smoke`` runs the program's whole code path on CPU ranks (gloo) in seconds: one spawn per world
(2, then 1), the checks against single-process flexattn by the flash-attention rule, torch's
context parallelism (forward only: torch's flex_attention has no backward on the CPU), the
throughput rows with the model's prediction, the JSON report and the table. The counts the TFLOP/s
figures rest on, and which cases the options select, need no ranks.
"""

import json

import pytest

from flexattn import create_mask
from benchmarks import context_parallel_gpus as gpus

ITERS = 2  # --smoke's timed iterations


def _setup(tmp_path, *argv):
    return gpus.make_setup(gpus.parse_args([*argv, "--out", str(tmp_path / "unused.json")]))


@pytest.mark.slow  # about 25 s on 2 CPU cores (two spawns of gloo ranks); CI runs it
def test_smoke_run_on_cpu_ranks(tmp_path, capsys):
    out = tmp_path / "cp_gpus.json"
    argv = ["--smoke", "--worlds", "1,2", "--check", "--torch", "--torch-check-masks", "causal",
            "--masks", "causal,document", "--tokens", "1024", "--check-tokens", "1024", "--balances", "mask,zigzag",
            "--all-balances-tokens", "0", "--model", "--out", str(out)]
    assert gpus.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["environment"]["multicast_env"] == gpus.MULTICAST_OFF
    assert set(report["worlds"]) == {"1", "2"}
    assert not any("failure" in world for world in report["worlds"].values()), report["worlds"]
    rows = report["rows"]

    checks = [r for r in rows if r["part"] == "check"]
    expected = {("flexattn", variant, balance) for variant in gpus.CHECK_VARIANTS for balance in ("mask", "zigzag")}
    expected |= {("torch_cp", "causal", balance) for balance in gpus.TORCH_BALANCES}
    assert {(r["impl"], r["mask"], r["balance"]) for r in checks} == expected
    for r in checks:
        assert r["world"] == 2 and r["ok"], r
        if r["impl"] == "flexattn":
            assert all(r[f"{name}_ok"] for name in ("out", "dq", "dk", "dv")), r
        else:
            assert r["out_ok"] and "backward" in r, r

    throughput = [r for r in rows if r["part"] == "throughput"]
    assert {(r["impl"], r["mask"], r["world"], r["balance"]) for r in throughput} == {
        (impl, mask, world, balance)
        for mask in ("causal", "document")
        for impl, world, balance in [("flexattn", 1, None), ("flexattn", 2, "mask"), ("torch_cp", 1, None),
                                     ("torch_cp", 2, "ptrr")]}
    for r in throughput:
        assert "error" not in r and "skipped" not in r, r
        assert r["ms"] > 0 and len(r["ms_iterations"]) == ITERS and min(r["ms_iterations"]) > 0, r
        assert r["tflops_per_gpu"] > 0 and r["tokens_per_s_per_gpu"] * r["world"] == pytest.approx(r["tokens_per_s"])
        assert r["peak_gib_per_rank"] is None and r["peak_gib"] is None  # no CUDA memory on CPU ranks
        assert 0 < r["density_pairs"] <= r["density_tiles"] <= 1
        if r["impl"] == "flexattn":
            assert r["model_ms"] > 0
            if r["world"] == 2:
                assert r["schedule"] in ("ring", "allgather") and "2 ranks" in r["plan"]
        else:
            assert "backward" in r  # forward only on the CPU, and said so

    capsys.readouterr()
    assert gpus.main(["--table", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| causal | 1k | 2 | flexattn | mask |" in table and "check torch_cp causal world 2 ptrr: pass" in table


@pytest.mark.parametrize("name", gpus.THROUGHPUT_MASKS)
def test_flops_count_the_pairs_each_mask_keeps(tmp_path, name):
    setup = _setup(tmp_path, "--smoke")
    tokens = 2048  # several documents of 256 to 1024 tokens; a window of 512
    mask_mod, _ = gpus.throughput_mods(setup, name, tokens, "cpu")
    kept = int(create_mask(mask_mod, None, None, tokens, tokens, device="cpu").sum())
    assert gpus.allowed_pairs(setup, name, tokens) == kept


def test_document_lengths_stay_in_range():
    for total in (131072, 262144, 524288, 100_000):
        lengths = gpus.document_lengths(total, 8192, 65536)
        assert sum(lengths) == total and all(8192 <= n <= 65536 for n in lengths), lengths
        assert lengths == gpus.document_lengths(total, 8192, 65536)  # every rank draws the same


def test_options_select_the_cases(tmp_path):
    setup = _setup(tmp_path, "--device", "cuda", "--torch", "--balances", "mask,zigzag", "--all-balances-tokens",
                   "131072", "--world-tokens", "1=131072", "--torch-compile", "dynamic", "--torch-calibrate", "--check")
    one = gpus.throughput_cases(setup, 1)
    assert {c.tokens for c in one} == {131072}
    assert [c.compile for c in one if c.impl == "torch_cp"].count("static") == 1  # the calibration
    two = gpus.throughput_cases(setup, 2)
    for case in two:
        first = case.balance == (setup.balances if case.impl == "flexattn" else setup.torch_balances)[0]
        assert first or case.tokens == 131072, case
    assert {c.tokens for c in two} == {131072, 262144, 524288}
    assert gpus.check_cases(setup, 1) == []
    assert {c.tokens for c in gpus.check_cases(setup, 2)} == {32768}
    checked_only = _setup(tmp_path, "--device", "cuda", "--torch", "--throughput-impls", "flexattn", "--check")
    assert {c.impl for c in gpus.throughput_cases(checked_only, 2)} == {"flexattn"}
    assert {c.impl for c in gpus.check_cases(checked_only, 2)} == {"flexattn", "torch_cp"}


def test_the_costliest_cases_run_last(tmp_path):
    setup = _setup(tmp_path, "--device", "cuda", "--torch")
    for world in (1, 2):
        groups = [key for key, _ in gpus.throughput_groups(setup, world)]
        assert groups[-1] == ("causal", 524288) and len(groups) == 9, groups
    assert gpus.world_seconds(setup, 1) > gpus.world_seconds(setup, 2) / 3  # world 1 keeps its share
