"""The kernel index ([Note] The kernel index in flexattn/codegen/source.py): a process whose disk
cache holds a family's source imports it without lowering or rendering, and a stale or damaged
entry costs a render, never a wrong kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)

FIRST_CALL = r"""
import json, sys, torch, flexattn
from flexattn.codegen import counts
from flexattn.variants import generate_alibi_bias, causal_mask
q, k, v = (torch.randn(1, 4, 96, 32, requires_grad=True) for _ in range(3))
bm = flexattn.create_block_mask(causal_mask, None, None, 96, 96, device="cpu")
out = flexattn.flex_attention(q, k, v, score_mod=generate_alibi_bias(4, "cpu"), block_mask=bm,
                              kernel_options={"BACKEND": "TRITON"})
out.sum().backward()
ref = flexattn.reference.reference_attention(*(t.double() for t in (q, k, v)),
                                             score_mod=generate_alibi_bias(4, "cpu"), mask_mod=causal_mask)[0]
print(json.dumps({"renders": counts.renders, "hits": counts.index_hits, "sympy": "sympy" in sys.modules,
                  "jinja2": "jinja2" in sys.modules, "err": float((out.double() - ref).abs().max())}))
"""


def first_call(cache: Path, extra: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "FLEXATTN_CACHE_DIR": str(cache), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", extra + FIRST_CALL], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_warm_process_neither_lowers_nor_renders(tmp_path):
    cold = first_call(tmp_path)
    assert cold["renders"] == 2 and cold["hits"] == 0  # the forward and the backward family
    warm = first_call(tmp_path)
    assert warm == {**warm, "renders": 0, "hits": 2} and warm["err"] < 1e-5
    assert not warm["sympy"]  # only lowering uses sympy (0.9 s to import): lowering/index.py
    assert not warm["jinja2"]  # only rendering uses jinja2: codegen/source.py's _templates
    # A damaged source file is not imported: that family renders again, and the result is right.
    kernels = sorted((tmp_path / "kernels").glob("bwd_*.py"))
    assert kernels
    kernels[0].write_text(kernels[0].read_text().replace("tl.", "tl .", 1))
    damaged = first_call(tmp_path)
    assert damaged["renders"] == 1 and damaged["hits"] == 1 and damaged["err"] < 1e-5
    # A process that registers a lowering of its own does not use the index.
    own = "import torch\nfrom flexattn.lowering import register_lowering\n" \
          "register_lowering(torch.ops.aten.log1p, lambda x: f'tl.log(1.0 + {x})')\n"
    assert first_call(tmp_path, own)["hits"] == 0


def test_import_flexattn_leaves_sympy_and_jinja2_unimported():
    # Issue 52: `import flexattn` should cost little beyond `import torch`; sympy alone took 0.9 s,
    # jinja2 (whose lexer compiles large regular expressions at import) 25-65 ms on 2 CPU cores.
    code = "import sys, flexattn; print('sympy' in sys.modules, 'jinja2' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False False"


def test_an_edit_anywhere_in_the_package_changes_the_code_digest(tmp_path, monkeypatch):
    # The families' spec builders (kernels/) decide what is rendered as much as the templates do: an
    # edit there must not let an older process's entry serve the newer code.
    import shutil

    from flexattn.codegen import source

    package = tmp_path / "flexattn"
    shutil.copytree(Path(ROOT) / "flexattn", package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(source, "__file__", str(package / "codegen" / "source.py"))
    before = source._code_digest()
    assert source._code_digest() == before
    family = package / "kernels" / "family.py"
    family.write_text(family.read_text() + "\n# an edit\n")
    assert source._code_digest() != before


EVERY_VARIANT = r"""
import gc, json, sys
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
import test_differential
from flexattn.codegen import counts
gc.freeze()  # as tests/conftest.py's collect_new_objects_only: the sweep's collections walk its own objects
test_differential.test_every_variant_in_one_process_against_the_reference(None, None)  # raises on a wrong result
print(json.dumps({"renders": counts.renders, "hits": counts.index_hits}))
"""


@pytest.mark.slow  # two processes of the catalogue's differential sweep: about 100 s on 2 CPU cores
def test_a_warm_process_computes_every_variant_right_from_the_index(tmp_path):
    # The index is a cache between processes: whatever its key leaves out, a warm process would get
    # another mod's kernel. Every catalogue variant (with its parameters, shapes and block sizes, and
    # both backends) runs against the float64 reference in a cold process, then again in a process
    # whose kernels all come from the index.
    env = {**os.environ, "PYTHONPATH": ROOT, "FLEXATTN_CACHE_DIR": str(tmp_path), "TRITON_INTERPRET": "1"}

    def sweep() -> dict:
        done = subprocess.run([sys.executable, "-c", EVERY_VARIANT], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = sweep()
    assert cold["renders"] > 20
    warm = sweep()
    assert warm["renders"] == 0 and warm["hits"] == cold["renders"] + cold["hits"]
