"""Fill the generated blocks of docs/worked_example.md from what flexattn produces today.

    python docs/gen_worked_example.py           # rewrite the blocks in place
    python docs/gen_worked_example.py --check   # exit 1 if a block differs from a fresh generation

The page is prose around blocks fenced by ``<!-- generated:NAME -->`` / ``<!-- /generated:NAME -->``;
each block is rebuilt here from flexattn's own stages (trace, lower, render), for ALiBi + causal at
B=1, H=8, 1024 x 1024, the same calls ``flex_attention`` makes for such a call on the Triton
backend. tests/test_docs.py runs the check, so the page never shows code flexattn no longer writes.

flexattn has no public "kernel source for these mods" function yet; ``forward_source`` below is
what this script needs from one (see the report of issue 11).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "worked_example.md"

B, H, Q_LEN, KV_LEN = 1, 8, 1024, 1024
BLOCK_PATTERN = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)


# The mods as a user writes them (flexattn.variants has the same two as generate_alibi_bias and
# causal_mask; they are spelled out here so the page does not change when the catalogue does).
def make_alibi(num_heads: int):
    slopes = torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32) / num_heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def forward_source(score_mod, mask_mod, *, bounds):
    """The forward kernel flexattn renders for these mods: (CompiledForward, score TracedMod, mask
    TracedMod). ``bounds`` None gives the source that is right at any lengths."""
    from flexattn.kernels import forward_kernel
    from flexattn.trace import trace_mod

    score, _ = trace_mod(score_mod, "score_mod")
    mask, _ = trace_mod(mask_mod, "mask_mod")
    return forward_kernel(score, mask, tanh_approx=False).compiled(bounds), score, mask


def _function(source: str, name: str) -> str:
    """The text of top-level function ``name`` in ``source``, decorators included."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            return "\n".join(lines[start:node.end_lineno])
    raise LookupError(f"the generated kernel has no function {name!r}; update docs/gen_worked_example.py")


def _between(source: str, first: str, last: str) -> str:
    """Lines of ``source`` from the one that starts with ``first`` (stripped) up to, not including,
    the one that starts with ``last``."""
    lines = source.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith(first)]
    if not starts:
        raise LookupError(f"the generated kernel has no line starting with {first!r}; update the script")
    begin = starts[0]
    for end in range(begin + 1, len(lines)):
        if lines[end].strip().startswith(last):
            return "\n".join(lines[begin:end]).rstrip()
    raise LookupError(f"no line starting with {last!r} after {first!r}; update docs/gen_worked_example.py")


def _code(text: str, lang: str = "python") -> str:
    return f"```{lang}\n{text.strip(chr(10))}\n```\n"


def blocks() -> dict[str, str]:
    sys.path.insert(0, str(ROOT))
    import flexattn
    from flexattn.lowering import index_bounds

    alibi = make_alibi(H)
    compiled, score, mask = forward_source(alibi, causal, bounds=index_bounds(B, H, Q_LEN, KV_LEN))
    any_length, _, _ = forward_source(alibi, causal, bounds=None)
    source = compiled.source
    block_mask = flexattn.create_block_mask(causal, None, None, Q_LEN, KV_LEN, device="cpu")
    # The picture's lines end in spaces (empty tiles); editors strip them, so the page does not keep them.
    picture = "\n".join(line.rstrip() for line in str(block_mask).splitlines())

    def graph_text(traced) -> str:
        return "\n".join(line for line in traced.graph_module.code.splitlines() if line.strip())

    def lowered_text(lowered) -> str:
        return "\n".join([
            f"lines         = {lowered.lines!r}",
            f"result        = {lowered.result!r}",
            f"kernel_params = {lowered.kernel_params!r}",
        ])

    signature = _between(source, "def flex_attention_forward(", "tl.static_assert")
    return {
        "mods": _code(inspect.getsource(make_alibi) + "\n\n" + inspect.getsource(causal)),
        "block-mask": _code(picture + "\n" + repr(block_mask), "text"),
        "tables": _code("\n".join([
            f"kv_num_blocks[0, 0]      = {block_mask.kv_num_blocks[0, 0].tolist()}",
            f"kv_indices[0, 0, :, 0]   = {block_mask.kv_indices[0, 0, :, 0].tolist()}",
            f"full_kv_num_blocks[0, 0] = {block_mask.full_kv_num_blocks[0, 0].tolist()}",
            f"full_kv_indices[0, 0, 3] = {block_mask.full_kv_indices[0, 0, 3].tolist()}",
        ]), "text"),
        "graphs": _code(graph_text(score) + "\n\n" + graph_text(mask)),
        "lowered": _code("# score_mod (prefix sm_)\n" + lowered_text(compiled.spec.score_mod)
                         + "\n# mask_mod (prefix mm_)\n" + lowered_text(compiled.spec.mask_mod)),
        # Triton source runs only inside its generated module (excerpts, too): text, not python, since
        # tests/test_doc_examples.py runs every python block of the docs as copied.
        "hooks": _code(_function(source, "score_mod") + "\n\n\n" + _function(source, "mask_mod"), "text"),
        "hooks-any-length": _code(_function(any_length.source, "score_mod"), "text"),
        "signature": _code("@triton.jit\n" + signature, "text"),
        "rows": _code(_between(source, "if HAS_PARTIAL_BLOCKS:", "# [Note] Fully masked rows"), "text"),
        "tile": _code(_function(source, "forward_tile"), "text"),
        "file-name": _code(f"{compiled.spec.readable_name()}_<sha256 of the source, 16 hex digits>.py", "text"),
    }


def fill(page: str, generated: dict[str, str]) -> str:
    seen = set()

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in generated:
            raise KeyError(f"docs/worked_example.md has a block {name!r} that the script does not generate")
        seen.add(name)
        return match.group(1) + generated[name] + match.group(4)

    text = BLOCK_PATTERN.sub(replace, page)
    missing = set(generated) - seen
    if missing:
        raise KeyError(f"docs/worked_example.md lacks the blocks {sorted(missing)}")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated block is out of date")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    text = fill(page, blocks())
    if args.check:
        if text != page:
            print("docs/worked_example.md is out of date: run python docs/gen_worked_example.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
