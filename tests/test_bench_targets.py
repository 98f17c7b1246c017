"""The lab's speed targets (benchmarks/targets.py): which rows miss them, that the keys they read are
the keys the benchmarks write, and that the package's benchmarks print none of them themselves."""

import json
from pathlib import Path

import pytest

from benchmarks import targets
from benchmarks.targets import BACKWARD, FORWARD, TRAINING, misses, not_measured, report, targets_for

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
    runs = ((FORWARD_RUN, 22, FORWARD), (BACKWARD_RUN, 22, BACKWARD), (BACKWARD_RUN, 53, TRAINING))
    for path, issue, expected in runs:
        rows = json.loads(path.read_text())["rows"]
        assert targets_for(rows, issue) is expected
        written = {key for row in rows for key in row}
        assert {target.key for target in expected} <= written, path.name
    assert targets_for(json.loads(FORWARD_RUN.read_text())["rows"], 53) == ()  # issue 53 reads the training rows


def gqa_row(variant="causal", **ratios):
    return {"variant": variant, "D": 128, "B": 2, "H": 32, "H_kv": 8, "L": 8192, "bwd_ms": 1.0, **ratios}


def test_issue_53_holds_every_row_to_flash_forward_and_backward_and_to_cudnn():
    causal = gqa_row(bwd_ratio_vs_torch_flash=0.72, bwd_ratio_vs_cudnn=0.82, fwd_ratio_vs_torch_flash=0.99,
                     bwd_ratio_vs_two_pass=1.1)
    assert misses([causal], TRAINING) == [
        "causal d=128 B2 H32:8 8k: 0.720x torch's FLASH path, backward (target 1.00x)",
        "causal d=128 B2 H32:8 8k: 0.820x SDPA cuDNN, backward (target 1.00x)",
        "causal d=128 B2 H32:8 8k: 0.990x torch's FLASH path, forward (target 1.00x)",
    ]
    # A mask cuDNN cannot express is still held to torch's FLASH path, where issue 22 held only the dense cases.
    documents = gqa_row("document_mask", bwd_ratio_vs_torch_flash=0.95, fwd_ratio_vs_torch_flash=1.1,
                        bwd_ratio_vs_two_pass=1.16)
    assert misses([documents], BACKWARD) == ["document_mask d=128 B2 H32:8 8k: 1.160x the deterministic backward's "
                                             "time over the default's (target at most 1.15x)"]
    assert len(misses([documents], TRAINING)) == 2


def test_issue_53_says_which_rows_lack_torchs_flash_path_and_why():
    failed = gqa_row(torch_flash_error="NotImplementedError: no", bwd_ratio_vs_two_pass=1.0)
    unasked = gqa_row("document_mask", L=32768, B=1)
    assert not_measured([failed, unasked], TRAINING) == [
        "causal d=128 B2 H32:8 8k: torch's FLASH path, backward: NotImplementedError: no",
        "causal d=128 B2 H32:8 8k: torch's FLASH path, forward: NotImplementedError: no",
        "document_mask d=128 B1 H32:8 32k: torch's FLASH path, backward: not run (no --torch-flash)",
        "document_mask d=128 B1 H32:8 32k: torch's FLASH path, forward: not run (no --torch-flash)",
        "document_mask d=128 B1 H32:8 32k: the deterministic backward's time over the default's: "
        "not run (no --two-pass)",
    ]
    assert not_measured([unasked], BACKWARD) == []  # issue 22's targets: what a run did not measure says nothing


def test_a_stored_run_reads_back_under_issue_53(capsys):
    assert targets.main(["--issue", "53", str(FORWARD_RUN), str(BACKWARD_RUN)]) == 0
    out = capsys.readouterr().out
    assert "issue 53 has no targets for the forward benchmark's rows" in out
    # That H200 run's causal backward at d=128: torch's FLASH path 9.23 ms, flexattn 9.85 ms.
    assert "below target: causal d=128 B2 H16 16k: 0.937x torch's FLASH path, backward (target 1.00x)" in out
    for wrong in (["--issue", "21", str(BACKWARD_RUN)], ["--issue", "53", "--run", "fwd"]):
        with pytest.raises(SystemExit):
            targets.main(wrong)


def test_the_stored_runs_read_back(capsys):
    assert targets.main([str(FORWARD_RUN), str(BACKWARD_RUN)]) == 0
    out = capsys.readouterr().out
    assert f"{FORWARD_RUN}: forward, 14 cases (gpu NVIDIA H200" in out
    # That run's forward missed torch's FLASH path at d=128 without a mask (0.96x).
    assert "below target: noop d=128 B4 H16 16k: 0.96" in out and "BACKEND FLASH (target 1.00x)" in out


def test_a_run_of_the_training_benchmark_ends_with_its_misses(capsys, tmp_path):
    # --smoke on a CPU: the code path only; the stand-in for torch makes the ratios meaningless.
    out = tmp_path / "bwd.json"
    assert targets.main(["--run", "bwd", "--smoke", "--variants", "causal", "--head-dims", "32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    expected = misses(rows, BACKWARD)
    assert expected  # the stand-in's ratios miss: the lines below are not vacuous
    assert [line[len("below target: "):] for line in printed.splitlines() if line.startswith("below target: ")] == expected


def test_issue_53s_run_of_the_training_benchmark_has_grouped_heads_rows(capsys, tmp_path):
    # --smoke on a CPU with GQA 4:2 and MHA: the code path only. No --torch-flash: "not measured" lines.
    out = tmp_path / "train.json"
    assert targets.main(["--issue", "53", "--run", "bwd", "--smoke", "--variants", "causal", "--head-dims", "16",
                         "--heads", "4:2", "2", "--seq-len", "128", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(row["H"], row["H_kv"], row["grad_check"]) for row in rows] == [(4, 2, "ok"), (2, 2, "ok")]
    gqa = rows[0]
    assert set(gqa["rel_err_vs_oracle"]) == {"flexattn", "torch_flex"}  # the oracle ran on the group
    assert "sdpa_flash_bwd_ms" in gqa  # SDPA took the grouped heads (enable_gqa)
    assert "| causal | 16 | B1 H4:2 128 |" in printed
    expected = report(rows, TRAINING)
    assert any(line.startswith("not measured: causal d=16 B1 H4:2 128") for line in expected)
    assert [line for line in printed.splitlines() if line.startswith(("below target: ", "not measured: "))] == expected


def test_the_packages_benchmark_prints_no_targets(capsys, tmp_path):
    from flexattn.bench import run_mode

    assert run_mode("bwd", ["--smoke", "--variants", "causal", "--head-dims", "32", "--out", str(tmp_path / "b.json")]) == 0
    assert "below target" not in capsys.readouterr().out
