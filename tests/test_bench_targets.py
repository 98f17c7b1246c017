"""The lab's speed targets (benchmarks/targets.py): which rows miss them, that the keys they read are
the keys the benchmarks write, and that the package's benchmarks print none of them themselves."""

import json
from pathlib import Path

from benchmarks import targets
from benchmarks.targets import BACKWARD, FORWARD, misses, targets_for

DATA = Path(__file__).resolve().parent.parent / "docs" / "data"
# The last side-by-side runs with every column measured (torch's FLASH path, cuDNN, the deterministic form).
FORWARD_RUN = DATA / "bench_fwd_flash4_h200_2026-11-28_ninth.json"
BACKWARD_RUN = DATA / "bench_bwd_flash4_h200_2026-11-28_ninth_d128.json"


def backward_row(variant="noop", **ratios):
    return {"variant": variant, "D": 64, "bwd_ms": 1.0, **ratios}


def test_a_row_that_meets_every_target_says_nothing():
    row = backward_row(bwd_speedup_vs_torch_flex=1.3, bwd_ratio_vs_torch_flash=0.9, bwd_ratio_vs_cudnn=1.0,
                       bwd_ratio_vs_two_pass=1.15)
    assert misses([row], BACKWARD) == []


def test_each_miss_is_one_line_with_three_digits():
    row = backward_row("causal", bwd_speedup_vs_torch_flex=1.29, bwd_ratio_vs_torch_flash=0.897,
                       bwd_ratio_vs_cudnn=1.2, bwd_ratio_vs_two_pass=1.151)
    lines = misses([row], BACKWARD)
    assert len(lines) == 3
    assert lines[0] == "causal d=64: 1.290x torch's compiled flex_attention (Triton) (target 1.30x)"
    assert "0.897x torch's flex_attention, BACKEND FLASH (target 0.90x)" in lines[1]  # not "0.90x (target 0.9x)"
    assert "1.151x the deterministic backward's time" in lines[2] and "at most 1.15x" in lines[2]


def test_targets_of_the_dense_cases_skip_masks_cudnn_cannot_express():
    row = backward_row("alibi", bwd_speedup_vs_torch_flex=2.0, bwd_ratio_vs_torch_flash=0.5, bwd_ratio_vs_cudnn=0.5)
    assert misses([row], BACKWARD) == []


def test_what_a_run_did_not_measure_is_not_checked():
    assert misses([backward_row(bwd_ratio_vs_cudnn=None)], BACKWARD) == []
    forward = {"variant": "noop", "D": 128, "flexattn_ms": 1.0, "speedup_vs_torch_flex": 1.2}
    assert misses([forward], FORWARD) == ["noop d=128: 1.200x torch's compiled flex_attention (Triton) (target 1.35x)"]


def test_the_keys_read_are_the_keys_the_benchmarks_write():
    for path, expected in ((FORWARD_RUN, FORWARD), (BACKWARD_RUN, BACKWARD)):
        rows = json.loads(path.read_text())["rows"]
        assert targets_for(rows) is expected
        written = {key for row in rows for key in row}
        assert {target.key for target in expected} <= written, path.name


def test_the_stored_runs_read_back(capsys):
    assert targets.main([str(FORWARD_RUN), str(BACKWARD_RUN)]) == 0
    out = capsys.readouterr().out
    assert f"{FORWARD_RUN}: forward, 14 cases (gpu NVIDIA H200" in out
    # That run's forward missed torch's FLASH path at d=128 without a mask (0.96x).
    assert "below target: noop d=128: 0.96" in out and "BACKEND FLASH (target 1.00x)" in out


def test_a_run_of_the_training_benchmark_ends_with_its_misses(capsys, tmp_path):
    # --smoke on a CPU: the code path only; the stand-in for torch makes the ratios meaningless.
    out = tmp_path / "bwd.json"
    assert targets.main(["--run", "bwd", "--smoke", "--variants", "causal", "--head-dims", "32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    expected = misses(rows, BACKWARD)
    assert expected  # the stand-in's ratios miss: the lines below are not vacuous
    assert [line[len("below target: "):] for line in printed.splitlines() if line.startswith("below target: ")] == expected


def test_the_packages_benchmark_prints_no_targets(capsys, tmp_path):
    from flexattn.bench import run_mode

    assert run_mode("bwd", ["--smoke", "--variants", "causal", "--head-dims", "32", "--out", str(tmp_path / "b.json")]) == 0
    assert "below target" not in capsys.readouterr().out
