"""The ``flexattn`` command: check, show, kernel, bench and list through ``main(argv)`` in-process, every
error path (one line, naming the argument and what is valid, exit status 2), and once through the
installed console script and ``python -m``."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from flexattn.cli import main
from flexattn.cli import check as job
from flexattn.cli.picture import EMPTY, FULL, PARTIAL, block_map, variant_mask
from flexattn.variants import CATALOGUE, Instance, Variant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def keep_threads():
    # `flexattn check` sets torch to one thread on a CPU, as a user's process would want; not the suite's.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


# -- list ---------------------------------------------------------------------------------------------


def test_list_names_every_variant_with_its_summary(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CATALOGUE)
    for line, (name, variant) in zip(lines, CATALOGUE.items()):
        assert line.startswith(name + " ") and variant.summary in line


# -- check --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU table (the GPU one has speed-up columns)")
def test_check_checks_and_times_the_chosen_variants(tmp_path, capsys, keep_threads):
    out = tmp_path / "results"
    assert main(["check", "--only", "causal,alibi", "--seq", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "causal" in printed and "alibi" in printed and "all 2 variants within tolerance" in printed
    assert str(out) + ".json" in printed.replace("\n", "")  # says where the results went
    report = json.loads((tmp_path / "results.json").read_text())
    assert [row["variant"] for row in report["rows"]] == ["causal", "alibi"]
    assert report["sizes"]["L"] == 256 and report["env"]["device"] == "cpu"
    for row in report["rows"]:
        assert row["ok"] and row["backend"] == "pytorch"
        assert 0 < row["fwd_err"] < 1e-5 and 0 < row["grad_err"] < 1e-5  # fp32 vs float64: small, not zero
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    assert report["rows"][0]["sparsity"] > 0  # causal skips the blocks above the diagonal
    markdown = (tmp_path / "results.md").read_text()
    assert "| variant | sparsity | fwd err | grad err |" in markdown and "| alibi |" in markdown


def test_check_only_writes_its_results_under_a_name_of_its_own(tmp_path, capsys, keep_threads, monkeypatch):
    # issue 19: `--only X` used to overwrite the full run's results (then gym-cpu.json and .md).
    from flexattn.cli.main import _default_results

    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    assert main(["check", "--device", "cpu", "--only", "causal,alibi", "--seq", "128"]) == 0
    results = tmp_path / "check"
    assert sorted(p.name for p in results.iterdir()) == ["check-cpu-only-causal-alibi.json", "check-cpu-only-causal-alibi.md"]
    assert str(results / "check-cpu-only-causal-alibi.json") in capsys.readouterr().out.replace("\n", "")
    assert _default_results("cpu", None) == results / "check-cpu"
    many = _default_results("cuda", list(CATALOGUE))  # a long list: a short name that still tells subsets apart
    assert many.name.startswith(f"check-cuda-only-{len(CATALOGUE)}-variants-") and len(many.name) < 60
    assert many != _default_results("cuda", list(CATALOGUE)[1:])


def test_check_exits_non_zero_when_an_error_exceeds_its_tolerance(tmp_path, capsys, keep_threads, monkeypatch):
    # fp32 errors against float64 are ~1e-7: a tolerance far below that must fail the run.
    monkeypatch.setitem(job.TOLERANCE, torch.float32, 1e-12)
    assert main(["check", "--device", "cpu", "--only", "causal", "--seq", "128", "--out", str(tmp_path / "r")]) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "1 of 1 variants FAILED: causal" in printed
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["ok"] is False


def test_check_reports_a_variant_that_raises_and_goes_on(tmp_path, capsys, keep_threads, monkeypatch):
    def broken(B, H, Q, KV, device):
        raise RuntimeError("this variant cannot be built")

    monkeypatch.setitem(CATALOGUE, "broken", Variant("broken", broken, "raises when built"))
    assert main(["check", "--device", "cpu", "--only", "broken,causal", "--seq", "128",
                 "--out", str(tmp_path / "r")]) == 1
    printed = capsys.readouterr().out
    assert "this variant cannot be built" in printed  # its footnote
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [row["ok"] for row in rows] == [False, True]


def test_check_counts_a_missing_learnable_gradient_as_a_failure(keep_threads):
    # A learnable tensor the output does not depend on through flexattn but does through the
    # reference: flexattn's gradient is None where the reference has one, an infinite error.
    bias = torch.randn(4, requires_grad=True)

    def make(B, H, Q, KV, device):
        class Inst(Instance):
            def reference(self, q, k, v, enable_gqa=False):
                return super().reference(q, k, v) + bias.sum().to(q.dtype) * 0.01

        return Inst(None, None, learnable=(bias,))

    row = job.run_variant("bias", Variant("bias", make, "test"), job.CheckSizes(1, 1, 64, 16, torch.float32), "cpu")
    assert row["ok"] is False and row["grad_err"] == float("inf")


@pytest.mark.gpu
def test_check_on_the_gpu_times_sdpa_and_torch_flex(tmp_path, capsys):
    assert main(["check", "--only", "causal,alibi", "--seq", "2048", "--out", str(tmp_path / "r")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    for row in rows:
        assert row["backend"] == "triton" and row["backend_bwd"] == "triton"
        assert row["sdpa"]["fwd_ms"] > 0 and row["sdpa"]["bwd_ms"] > 0
        assert row["torch_flex"]["error"] is None and row["torch_flex"]["bwd_ms"] > 0  # torch runs both
    assert rows[0]["sdpa"]["kind"] == "same" and rows[1]["sdpa"]["kind"] == "dense"  # causal vs ALiBi
    assert "x SDPA fwd" in capsys.readouterr().out


# -- show ---------------------------------------------------------------------------------------------


def test_show_prints_the_block_mask_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "causal.png"
    assert main(["show", "causal", "--seq", "512", "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "causal" in printed and "█" in printed and "░" in printed and f"wrote {png}" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > height > 100  # two pictures side by side


def test_show_of_a_short_sequence_draws_token_by_token(capsys):
    import flexattn.variants

    assert main(["show", "causal", "--seq", "16", "--no-png"]) == 0
    printed = capsys.readouterr().out
    if hasattr(flexattn.variants, "picture"):  # the variants' own token picture, where it exists
        assert "\n" + "\n".join("#" * (i + 1) + "-" * (15 - i) for i in range(16)) in printed


def test_block_map_has_full_partial_and_empty_blocks_where_causal_puts_them():
    bm, tokens = variant_mask(CATALOGUE["causal"].make(1, 1, 512, 512, "cpu"), 512, 512)
    blocks = block_map(bm)
    rows = blocks.shape[0]
    expected = torch.full((rows, rows), EMPTY)
    expected[torch.ones(rows, rows, dtype=torch.bool).tril(-1)] = FULL
    expected[torch.eye(rows, dtype=torch.bool)] = PARTIAL
    assert torch.equal(blocks, expected)
    assert torch.equal(tokens, torch.ones(512, 512, dtype=torch.bool).tril())


def test_show_without_a_mask_draws_every_block_full(tmp_path, capsys):
    assert main(["show", "softcap", "--seq", "256", "--no-png"]) == 0
    assert "no mask_mod: every block is full" in capsys.readouterr().out
    bm, _ = variant_mask(CATALOGUE["softcap"].make(1, 1, 256, 256, "cpu"), 256, 256)
    assert bool((block_map(bm) == FULL).all())


# -- kernel -------------------------------------------------------------------------------------------


def test_kernel_prints_the_generated_triton_source(capsys):
    assert main(["kernel", "alibi", "--seq", "256"]) == 0
    forward = capsys.readouterr().out
    assert "@triton.jit" in forward and "def flex_attention_forward" in forward
    assert "def score_mod" in forward and "slopes" in forward  # ALiBi's captured slopes, loaded in the kernel
    assert main(["kernel", "alibi", "--seq", "256", "--backward"]) == 0
    backward = capsys.readouterr().out
    assert "def flex_attention_backward" in backward and backward != forward
    assert main(["kernel", "causal", "--seq", "256", "--decode"]) == 0
    assert "def flex_attention_decode" in capsys.readouterr().out


# -- bench --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("mode", ["fwd", "bwd", "decode", "host"])
def test_bench_says_it_needs_a_gpu(mode, capsys):
    assert main(["bench", "--mode", mode]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and f"--mode {mode}" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_python_m_flexattn_bench_host_says_it_needs_a_gpu(capsys):
    from flexattn.bench.__main__ import main as bench_main

    assert bench_main(["--mode", "host"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "--mode host needs a CUDA GPU" in captured.err


def test_the_host_mode_is_registered_and_its_help_needs_no_gpu(capsys):
    from flexattn.bench import MODES

    assert MODES["host"] == "flexattn.bench.host"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--mode", "host", "--", "--help"])  # through the CLI's GPU check
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(option in out for option in ("--calls", "--skip-torch", "--skip-first-call", "--out"))


def test_the_first_call_processes_read_cached_bytecode(monkeypatch):
    # A package's bytecode is on disk after pip install: the timed fresh processes must not compile
    # torch's sources (they did on the lent GPUs, whose image has no bytecode), so an untimed process
    # on throwaway kernel caches writes it first.
    import flexattn.bench.host as host

    runs = []
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(host, "first_call", lambda lib, cache_dir, env: runs.append((cache_dir, env)) or {})
    host.first_calls("flexattn")
    (throwaway, env0), (cold, env1), (warm, env2) = runs
    assert throwaway != cold == warm
    for env in (env0, env1, env2):
        assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == env0["PYTHONPYCACHEPREFIX"]


def _host_result(cold_flexattn_s=2.0):
    """A made-up run of ``flexattn bench --mode host``, with a flexattn row the GPU held back."""
    from flexattn.bench.host import CASES

    warm = {case: {"flexattn_host_us": 30.0, "flexattn_gpu_us": 10.0, "torch_host_us": 80.0, "torch_gpu_us": 12.0}
            for case in CASES}
    warm["fwd_bwd"].update(flexattn_host_us=90.0, flexattn_gpu_us=95.0)
    run = {"first_call_s": cold_flexattn_s, "cuda_context_s": 0.3, "import_torch_s": 1.0, "import_lib_s": 0.2,
           "process_s": 4.0}
    first = {"flexattn": {"cold": run, "warm": dict(run, first_call_s=0.9)},
             "torch": {"cold": dict(run, first_call_s=10.0), "warm": {"error": "RuntimeError: out of memory"}}}
    env = {"device": "NVIDIA H100", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3",
           "flexattn_commit": "abc123", "calls": 500}
    return {"env": env, "warm": warm, "first_call": first}


def test_the_host_table_checks_the_targets_and_flags_a_row_the_gpu_held_back(tmp_path):
    from flexattn.bench.host import table, write_json

    text = table(_host_result())
    assert text.startswith("NVIDIA H100, torch 2.11.0, Triton 3.6.0, CUDA 13.0, Python 3.12.3, flexattn abc123")
    assert "| fwd, ALiBi + causal BlockMask | 30.0 | 80.0 | ≤ 40 µs met | 10.0 | 12.0 |" in text
    assert "| fwd + bwd, ALiBi + causal | 90.0 | 80.0 | ≤ 80 µs **missed** | **95.0, not below the host's** |" in text
    assert "| fwd, no mods | 30.0 | 80.0 | - |" in text and "may measure the GPU, not the host" in text
    assert "| cold caches: first call | 2.00 | 10.00 | ≤ 0.6x torch met (0.20x) |" in text
    assert "| warm caches: CUDA context + first call | 1.20 | - | ≤ 1.5 s met |" in text
    assert "failed: torch warm: RuntimeError: out of memory" in text
    assert "**missed** (0.90x)" in table(_host_result(cold_flexattn_s=9.0))
    path = tmp_path / "host.json"
    write_json(str(path), _host_result())
    assert json.loads(path.read_text()) == _host_result()


def test_the_host_mode_prints_the_tables_of_a_saved_run_without_a_gpu(tmp_path, capsys):
    from flexattn.bench.host import main as host_main, table, write_json

    cut_short = _host_result()
    del cut_short["warm"]["decode"], cut_short["first_call"]["torch"]  # a run stopped before its end
    write_json(str(tmp_path / "host.json"), cut_short)
    assert host_main(["--table", str(tmp_path / "host.json")]) == 0
    out = capsys.readouterr().out
    assert out == table(cut_short) + "\n"
    assert "| decode step, ALiBi, GQA 16:2, 1k keys | - | - | ≤ 30 µs | - | - |" in out


def test_the_host_table_without_torch_or_first_calls():
    from flexattn.bench.host import table

    result = _host_result()
    del result["first_call"]
    for row in result["warm"].values():
        for key in ("torch_host_us", "torch_gpu_us"):
            del row[key]
    result["warm"]["fwd_bwd"]["flexattn_gpu_us"] = 20.0
    text = table(result)
    assert "| decode step, ALiBi, GQA 16:2, 1k keys | 30.0 | - | ≤ 30 µs met | 10.0 | - |" in text
    assert "so the host times are the host's" in text and "first call" not in text
    result["warm"]["decode"] = {"flexattn_error": "RuntimeError: no decode"}  # a failed case: recorded, not fatal
    text = table(result)
    assert "| decode step, ALiBi, GQA 16:2, 1k keys | - | - | ≤ 30 µs | - | - |" in text
    assert "\n\nfailed: flexattn decode: RuntimeError: no decode\n" in text  # after the table, not in it


def test_the_host_table_says_when_outputs_were_poisoned():
    from flexattn.bench.host import table

    result = _host_result()
    assert "POISON" not in table(result)
    result["env"]["poisoned_outputs"] = True  # the test suite's NaN fills: not what users run
    assert "FLEXATTN_POISON_OUTPUTS was set" in table(result)


@pytest.mark.gpu
def test_bench_host_on_the_gpu_writes_positive_numbers(tmp_path, capsys):
    from flexattn.bench.host import CASES, main as host_main

    out = tmp_path / "host.json"
    assert host_main(["--calls", "20", "--skip-first-call", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "first_call" not in result and result["env"]["device"]
    for case in CASES:
        for key in ("flexattn_host_us", "flexattn_gpu_us", "torch_host_us", "torch_gpu_us"):
            assert (result["warm"][case][key] or 0) > 0, (case, key)
    assert "| warm call, µs per call |" in capsys.readouterr().out


# -- errors and --help --------------------------------------------------------------------------------

NO_GPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.mark.parametrize("argv, names", [
    (["show", "nope"], ["argument NAME", "unknown variant 'nope'", "causal", "alibi"]),
    (["show", "causl"], ["did you mean 'causal'"]),
    (["kernel", "nope"], ["argument NAME", "unknown variant", "causal"]),
    (["check", "--only", "causal,nope"], ["argument --only", "unknown variant 'nope'", "alibi"]),
    (["check", "--only", "causal,,alibi"], ["argument --only", "no empty names"]),
    (["check", "--seq", "abc"], ["argument --seq", "from 16 to"]),
    (["check", "--seq", "-5"], ["argument --seq", "'-5'"]),
    (["show", "causal", "--seq", "0"], ["argument --seq", "from 16 to"]),
    (["kernel", "causal", "--seq", "8"], ["argument --seq", "from 16 to"]),
    (["show", "causal", "--seq", str(10**9)], ["argument --seq", "131072"]),
    (["kernel", "causal", "--heads", "0"], ["argument --heads"]),
    (["check", "--device", "tpu"], ["argument --device", "'cpu'", "'cuda'"]),
    (["bench", "--mode", "sideways"], ["argument --mode", "'decode'"]),
    (["frobnicate"], ["argument COMMAND", "'check'", "'show'"]),
    ([], ["COMMAND"]),
    (["kernel", "causal", "--backward", "--decode"], ["--decode", "--backward"]),
    (["check", "--", "--seq", "1"], ["'flexattn bench' only"]),
    pytest.param(["check", "--device", "cuda"], ["argument --device", "'cuda' is not available"], marks=NO_GPU_ONLY),
])
def test_bad_arguments_give_one_line_and_exit_2(argv, names, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    for name in names:
        assert name in captured.err


def test_kernel_decode_of_a_variant_without_a_decoding_form_is_refused(monkeypatch, capsys):
    monkeypatch.setitem(CATALOGUE, "packed", dataclasses.replace(CATALOGUE["document_mask"], name="packed", decode=False))
    with pytest.raises(SystemExit) as exited:
        main(["kernel", "packed", "--decode"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --decode" in err and "packed" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("module, command", [("rich", ["check", "--only", "causal", "--seq", "128"]),
                                             ("matplotlib", ["show", "causal", "--seq", "128"])])
def test_a_missing_extra_says_how_to_install_it(module, command, monkeypatch, capsys, tmp_path, keep_threads):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    monkeypatch.chdir(tmp_path)
    assert main(command) == 1
    err = capsys.readouterr().err
    assert f"'{module}'" in err and "pip install 'flexattn[cli]'" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("command", [[], ["check"], ["show"], ["kernel"], ["bench"], ["list"]])
def test_help_everywhere(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: flexattn" + "".join(" " + c for c in command))


@pytest.mark.parametrize("module", [f"flexattn.bench.{name}" for name in ("forward", "backward", "decode", "model", "fp8",
                                                                         "host")]
                         + [f"benchmarks.{name}" for name in ("learnable", "sweep", "sweep_backward", "tile_census",
                                                              "targets")])
def test_the_benchmarks_keep_their_help(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(["--help"])
    assert exited.value.code == 0 and "usage:" in capsys.readouterr().out


def test_python_m_flexattn_bench_takes_a_mode(capsys):
    from flexattn.bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exited:
        bench_main(["--mode", "bwd", "--help"])
    assert exited.value.code == 0 and "--smoke" in capsys.readouterr().out  # the training benchmark's options


def test_the_repository_examples_folder_is_no_package():
    # An examples/__init__.py would shadow any other `examples` package for anyone running from the checkout.
    assert not os.path.exists(os.path.join(ROOT, "examples", "__init__.py"))


# -- from any directory: python -m and the console script --------------------------------------------


def test_python_m_flexattn_runs_from_any_directory(tmp_path):
    ran = subprocess.run([sys.executable, "-m", "flexattn", "check", "--only", "causal", "--seq", "128", "--out", "r"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["variant"] == "causal"


def _console_script():
    here = os.path.dirname(sys.executable)
    return shutil.which("flexattn", path=here + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.skipif(_console_script() is None,
                    reason="the flexattn console script is not installed (pip install -e '.[cli]')")
def test_the_console_script_runs_the_main_job_and_reports_errors(tmp_path):
    script = _console_script()
    ran = subprocess.run([script, "check", "--only", "noop,softcap", "--seq", "128", "--out", "r"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "all 2 variants within tolerance" in ran.stdout
    bad = subprocess.run([script, "show", "nope"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown variant 'nope'" in bad.stderr


def test_the_gpu_table_gives_speed_ups_and_says_why_a_baseline_is_missing():
    from flexattn.cli.report import DENSE_MARK, table, to_markdown

    base = {"summary": "", "sparsity": 50.0, "fwd_err": 1e-3, "grad_err": 2e-3, "backend": "triton",
            "backend_bwd": "triton", "tolerance": 3e-2, "ok": True, "fwd_ms": 1.0, "bwd_ms": 2.0}
    rows = [
        {**base, "variant": "causal", "sdpa": {"kind": "same", "fwd_ms": 1.5, "bwd_ms": 3.0, "error": None},
         "torch_flex": {"fwd_ms": 1.2, "bwd_ms": 2.2, "error": None}},
        {**base, "variant": "t5_bias", "sdpa": {"kind": "dense", "fwd_ms": 2.0, "bwd_ms": 5.0, "error": None},
         "torch_flex": {"fwd_ms": 1.1, "bwd_ms": None, "error": "RuntimeError: captured buffers need grad"}},
    ]
    report = {"env": {"flexattn": "0", "device": "cuda", "device_name": "GPU", "torch": "2.11", "triton": "3.6"},
              "sizes": {"B": 1, "H": 16, "L": 4096, "D": 64, "dtype": "bfloat16"}, "rows": rows}
    headers, cells, notes = table(report)
    assert headers[7:11] == ["x SDPA fwd", "x SDPA bwd", "x torch fwd", "x torch bwd"]
    assert cells[0][7:11] == ["1.50x", "1.50x", "1.20x", "1.10x"]
    assert cells[1][7:10] == ["2.00x" + DENSE_MARK, "2.50x" + DENSE_MARK, "1.10x"]
    assert cells[1][10] == "n/a [1]" and notes[0].startswith("[1] torch's compiled flex_attention cannot run t5_bias")
    assert "captured buffers need grad" in notes[0] and any(note.startswith(DENSE_MARK) for note in notes)
    assert "| t5_bias | 50.0% |" in to_markdown(report)


def test_the_benchmarks_commit_says_when_the_files_differ_from_it(tmp_path):
    # A device copy of a working tree may carry an older commit's git metadata under newer files.
    from flexattn.bench.common import git_commit

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert git_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(str(tmp_path)) == head + "+changes"
    assert git_commit(str(tmp_path / "missing")) is None
