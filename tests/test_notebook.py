"""The notebook and the examples run, so they never rot.

* ``examples/tour.ipynb`` is executed with nbclient on the CPU (any cell error fails), and the committed
  copy must hold the outputs of a run over today's catalogue (every entry named in them).
* ``examples/*.py`` run as a user runs them, in a subprocess, and check themselves (a training
  loss that falls, a decoding loop that matches full-sequence attention without retracing).

Re-execute the committed notebook after changing it or the catalogue:

    python tests/test_notebook.py          # writes examples/tour.ipynb with fresh outputs (CPU)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "tour.ipynb"
EXAMPLES = ROOT / "examples"
CPU_ENV = {
    "CUDA_VISIBLE_DEVICES": "",  # the CPU path, also on a GPU machine
    "OMP_NUM_THREADS": "1",  # small problems on a shared machine: one thread is the steadiest
    "TRITON_INTERPRET": "0",
}


def _env(extra: dict) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def execute_notebook(path: Path = NOTEBOOK, timeout: int = 300, *, cpu: bool = True):
    """The notebook executed (raises CellExecutionError on the first failing cell); ``cpu``: with
    the GPU hidden, as CI and the committed copy run it."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ.update(_env(CPU_ENV if cpu else {"TRITON_INTERPRET": "0"}))  # the kernel process inherits it
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def _needs_jupyter():
    for module in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        pytest.importorskip(module, reason=f"the notebook test needs {module} (pip install nbclient ipykernel matplotlib)")


class _Notebook:
    def __init__(self, data: dict):
        self.cells = data["cells"]


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            text = output.get("text", "")
            parts.append("".join(text) if isinstance(text, list) else text)
            plain = output.get("data", {}).get("text/plain", "")
            parts.append("".join(plain) if isinstance(plain, list) else plain)
            if output.get("output_type") == "error":
                parts.append(f"ERROR {output.get('ename')}: {output.get('evalue')}")
    return "\n".join(parts)


@pytest.mark.slow
def test_tour_notebook_runs_on_cpu():
    _needs_jupyter()
    from flexattn.variants import CATALOGUE

    nb = execute_notebook()
    text = _outputs_text(nb)
    assert "ERROR" not in text
    assert f"checked {len(CATALOGUE)} entries" in text
    assert "no GPU here" in text


@pytest.mark.gpu
def test_tour_notebook_runs_on_gpu():
    # The same cells on the Triton kernels, with the timing cell's GPU branch.
    _needs_jupyter()
    from flexattn.variants import CATALOGUE

    text = _outputs_text(execute_notebook(cpu=False, timeout=600))
    assert "ERROR" not in text and "device cuda" in text
    assert f"checked {len(CATALOGUE)} entries" in text and "vs SDPA" in text


def test_committed_tour_notebook_holds_outputs_of_todays_catalogue():
    from flexattn.variants import CATALOGUE

    nb = _Notebook(json.loads(NOTEBOOK.read_text()))  # plain JSON: runs where Jupyter is not installed
    code_cells = [c for c in nb.cells if c["cell_type"] == "code"]
    assert code_cells and all(c.get("execution_count") for c in code_cells), (
        "examples/tour.ipynb must be committed executed: run `python tests/test_notebook.py`"
    )
    text = _outputs_text(nb)
    assert "ERROR" not in text, "the committed examples/tour.ipynb holds an error output"
    missing = [name for name in CATALOGUE if name not in text]
    assert not missing, (
        f"the committed examples/tour.ipynb predates the catalogue entries {missing}: re-execute it with "
        "`python tests/test_notebook.py` and commit it"
    )
    assert any("image/png" in o.get("data", {}) for c in code_cells for o in c["outputs"]), "the pictures are missing"


# ------------------------------------------------------------------------------------ examples


def run_example(name: str, *args: str, env: dict = CPU_ENV, timeout: int = 300) -> str:
    # A subprocess, as a user runs it: the environment conftest.py set up (TRITON_INTERPRET) stays out.
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=_env(env),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{name} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_train_learnable_bias_example_learns_on_cpu():
    out = run_example("train_learnable_bias.py", "--device", "cpu")
    assert "device cpu" in out and "loss " in out and "|d loss / d bias|" in out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_loop_example_matches_full_attention_on_cpu(paged):
    out = run_example("decode_loop.py", "--device", "cpu", *(["--paged"] if paged else []))
    assert ("paged cache" if paged else "contiguous cache") in out
    assert "traces after the first step: 0" in out


def test_examples_refuse_bad_sizes_with_a_message():
    result = subprocess.run([sys.executable, str(EXAMPLES / "decode_loop.py"), "--max-len", "16"], cwd=ROOT,
                            env=_env(CPU_ENV), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "must fit in --max-len" in result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("script, args", [
    ("train_learnable_bias.py", ("--seq", "256")),
    ("decode_loop.py", ()),
    ("decode_loop.py", ("--paged",)),
], ids=["train", "decode", "decode_paged"])
def test_examples_on_gpu(script, args):
    out = run_example(script, "--device", "cuda", *args, env={"TRITON_INTERPRET": "0"})
    assert "device cuda" in out


if __name__ == "__main__":
    import nbformat

    executed = execute_notebook()
    nbformat.write(executed, NOTEBOOK)
    print(f"wrote {NOTEBOOK.relative_to(ROOT)} with fresh outputs")
