"""Every ```python block of README.md and docs/*.md runs as copied, each in a fresh Python process.

The rules, which README.md states where it shows the first example:

* A block is run on its own, from an empty directory, with this checkout's flexattn importable and
  nothing else prepared: no names from other blocks, no TRITON_INTERPRET (a CPU user's set-up).
* A block that names the device ``"cuda"`` is written for a GPU. On a machine without one it runs
  after ``on_cpu``'s rewrite: the string ``"cuda"`` becomes ``"cpu"``, ``torch.bfloat16`` and
  ``torch.float16`` become ``torch.float32`` (16-bit matmuls are slow on a CPU), and
  every integer literal of 1024 or more is divided by 16 (8192 tokens: 512), so that it finishes in
  seconds. On a GPU (``test_cuda_block_runs_unchanged_on_the_gpu``) it runs as written.
* A block whose first line is ``# needs a CUDA GPU`` cannot run on a CPU at all (a CUDA graph, say):
  it is skipped here and run by the GPU test only.
* Anything that is not a script (signatures, excerpts of files, generated Triton source, output) is
  fenced as ```text, not ```python.

The selected blocks start together on first use, in subprocesses, one per core (each with one torch
thread): about half a minute for all of them on 2 cores.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
NEEDS_GPU = "# needs a CUDA GPU"
TIMEOUT_S = 180  # one block; the slowest (README's CUDA example, rewritten) takes a few seconds
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^\s`]*)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def for_cuda(self) -> bool:
        return bool(re.search(r"""(["'])cuda\1""", self.code))

    @property
    def needs_gpu(self) -> bool:
        return self.code.startswith(NEEDS_GPU)


def python_blocks(text: str, page: str) -> list[Block]:
    """The ```python blocks of a Markdown page, dedented (a block in a list item is indented)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if opening["lang"] == "python":
            blocks.append(Block(page, i + 1, textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"))
        i = end + 1
    return blocks


def on_cpu(code: str) -> str:
    """A CUDA block as it runs on a CPU (the rule in the module docstring), token by token, so that
    strings, comments and floats are left alone."""
    tokens: list[tokenize.TokenInfo] = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        text = tok.string
        if tok.type == tokenize.STRING and text in ('"cuda"', "'cuda'"):
            text = '"cpu"'
        elif tok.type == tokenize.NUMBER and re.fullmatch(r"[0-9_]+", text) and int(text) >= 1024:
            text = str(int(text) // 16)
        elif tok.type == tokenize.NAME and text in ("bfloat16", "float16") and tokens and tokens[-1].string == ".":
            text = "float32"
        tokens.append(tok._replace(string=text))
    # Full tokens keep the original spacing: untokenize places each at its column in the source.
    return tokenize.untokenize(tokens)


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in python_blocks(page.read_text(), str(page.relative_to(ROOT)))]


BLOCKS = _all_blocks()
HAS_CUDA = torch.cuda.is_available()
# Here: every block a CPU can run; on a GPU machine the CUDA blocks run as written instead (below).
HERE_BLOCKS = [b for b in BLOCKS if not b.needs_gpu and not (HAS_CUDA and b.for_cuda)]
GPU_BLOCKS = [b for b in BLOCKS if b.for_cuda or b.needs_gpu]


def code_here(block: Block) -> str:
    return on_cpu(block.code) if block.for_cuda and not HAS_CUDA else block.code


def run_block(code: str, workdir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # the blocks run side by side, one per core
    workdir.mkdir(parents=True, exist_ok=True)
    script = workdir / "block.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def cpu_runs(request, tmp_path_factory):
    """The selected blocks of test_block_runs, started at once on a pool of the machine's cores: block id -> Future."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_block_runs"]
    root = tmp_path_factory.mktemp("doc_examples")
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        futures: dict[str, Future] = {}
        for n, block in enumerate(selected):
            futures[block.id] = pool.submit(run_block, code_here(block), root / f"block{n}")
        yield futures


def _check(block: Block, ran: subprocess.CompletedProcess, code: str) -> None:
    if ran.returncode != 0:
        pytest.fail(f"{block.id} failed (exit {ran.returncode}); the code that ran:\n{code}\n"
                    f"--- stderr ---\n{ran.stderr[-4000:]}", pytrace=False)


@pytest.mark.parametrize("block", HERE_BLOCKS, ids=lambda b: b.id)
def test_block_runs(block, cpu_runs):
    _check(block, cpu_runs[block.id].result(), code_here(block))


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU_BLOCKS, ids=lambda b: b.id)
def test_cuda_block_runs_unchanged_on_the_gpu(block, tmp_path):
    _check(block, run_block(block.code, tmp_path), block.code)


# -- the rules themselves ---------------------------------------------------------------------------


def test_pages_have_examples_and_the_readme_starts_with_a_cuda_one():
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert len(readme) >= 2 and readme[0].for_cuda and not readme[1].for_cuda
    assert len(BLOCKS) >= 12  # README, adding_a_variant, block_mask, decoding, lowering, worked_example, ...


def test_extraction_finds_python_blocks_only_and_dedents_list_items():
    page = textwrap.dedent("""\
        Text.

        ```python
        x = 1
        ```

        1. An item:

           ```python
           def f():
               return 2
           ```

        ```text
        f(a, b) -> c
        ```

        ```bash
        echo no
        ```
        """)
    blocks = python_blocks(page, "page.md")
    assert [(b.line, b.code) for b in blocks] == [(3, "x = 1\n"), (9, "def f():\n    return 2\n")]


def test_the_cpu_rewrite():
    code = textwrap.dedent("""\
        x = torch.randn(4, 16, 8192, 64, device="cuda", dtype=torch.bfloat16)  # "cuda" in a comment stays
        y = torch.zeros(1024, 1000, 2.5e3, 0.5, dtype=torch.float16, device='cuda')
        label = "cuda graphs"
        """)
    assert on_cpu(code).splitlines() == [
        'x = torch.randn(4, 16, 512, 64, device="cpu", dtype=torch.float32)  # "cuda" in a comment stays',
        'y = torch.zeros(64, 1000, 2.5e3, 0.5, dtype=torch.float32, device="cpu")',
        'label = "cuda graphs"',
    ]
    assert Block("p.md", 1, code).for_cuda and not Block("p.md", 1, "import torch\n").for_cuda
    assert Block("p.md", 1, NEEDS_GPU + "\ng = torch.cuda.CUDAGraph()\n").needs_gpu


def test_a_failing_block_fails_the_test(tmp_path):
    ran = run_block("import flexattn\nraise SystemExit(3)\n", tmp_path)
    assert ran.returncode == 3
    assert run_block("import flexattn, os\nassert 'TRITON_INTERPRET' not in os.environ\n", tmp_path).returncode == 0
