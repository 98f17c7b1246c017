"""The docs cannot rot: generated pages equal a fresh generation, and every relative link resolves.

* docs/api.md is generated from the public docstrings by docs/gen_api.py;
* docs/worked_example.md's generated blocks (the traced graphs, the lowered expressions, the Triton
  source of ALiBi + causal) are rebuilt by docs/gen_worked_example.py from flexattn's own stages;
* every relative link in docs/*.md and README.md points at an existing file (and, for a link with
  ``#anchor`` into a Markdown file, at an existing heading).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_difference(committed: str, fresh: str) -> str:
    a, b = committed.splitlines(), fresh.splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1}:\n  committed: {x!r}\n  generated: {y!r}"
    return f"lengths differ: {len(a)} committed lines, {len(b)} generated"


def test_api_reference_matches_the_docstrings():
    gen_api = _load_script("gen_api")
    committed = (DOCS / "api.md").read_text()
    fresh = gen_api.render()
    assert committed == fresh, (
        "docs/api.md is out of date; run `python docs/gen_api.py` and commit it. First difference at "
        + _first_difference(committed, fresh)
    )


def test_api_reference_covers_every_public_name():
    import flexattn
    import flexattn.variants

    text = (DOCS / "api.md").read_text()
    for module in (flexattn, flexattn.variants):
        for name in module.__all__:
            assert f"### `{module.__name__}.{name}`" in text, f"{module.__name__}.{name} is missing from docs/api.md"
    for name in flexattn.variants.CATALOGUE:
        assert f"| `{name}` |" in text, f"catalogue entry {name!r} is missing from docs/api.md"
    # The options' descriptions come from options.py, through FlexKernelOptions' docstring.
    assert "BACKEND: Literal" in text and "BLOCK_M: int" in text


def test_worked_example_shows_the_kernel_flexattn_generates_today():
    pytest.importorskip("triton", reason="the kernel source is rendered and imported as the runtime does")
    gen = _load_script("gen_worked_example")
    page = (DOCS / "worked_example.md").read_text()
    fresh = gen.fill(page, gen.blocks())
    assert page == fresh, (
        "docs/worked_example.md shows code flexattn no longer generates; run `python docs/gen_worked_example.py`, "
        "check the prose around the changed blocks, and commit. First difference at " + _first_difference(page, fresh)
    )


def test_worked_example_generator_rejects_unknown_and_missing_blocks():
    gen = _load_script("gen_worked_example")
    with pytest.raises(KeyError, match="lacks the blocks"):
        gen.fill("no blocks at all\n", {"mods": "x\n"})
    with pytest.raises(KeyError, match="does not generate"):
        gen.fill("<!-- generated:nope -->\nold\n<!-- /generated:nope -->\n", {})
    page = "a\n<!-- generated:mods -->\nold\n<!-- /generated:mods -->\nb\n"
    assert gen.fill(page, {"mods": "new\n"}) == "a\n<!-- generated:mods -->\nnew\n<!-- /generated:mods -->\nb\n"


# ------------------------------------------------------------------------------------ links

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a link-like string in code is not a link)."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            kept.append(line)
    return "\n".join(kept)


def _github_anchor(heading: str) -> str:
    text = heading.strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    anchors, counts = set(), {}
    for line in _prose(markdown).splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if not match:
            continue
        slug = _github_anchor(match.group(1))
        n = counts.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        counts[slug] = n + 1
    return anchors


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = path if not file_part else (path.parent / file_part).resolve()
        if not resolved.exists():
            problems.append(f"{path.relative_to(root)}: {target} (no file {resolved})")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
            problems.append(f"{path.relative_to(root)}: {target} (no heading #{anchor} in {file_part or path.name})")
    return problems


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


def test_every_relative_link_resolves():
    problems = [p for page in _pages() for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [web](https://example.com) [missing](nowhere.md)\n"
        "[bad anchor](there.md#nope)\n```\n[in code](ignored.md)\n```\n"
    )
    problems = [p.split(": ", 1)[1] for p in broken_links(page, root=tmp_path)]
    assert problems == ["nowhere.md (no file " + str(tmp_path / "nowhere.md") + ")",
                        "there.md#nope (no heading #nope in there.md)"]



# ------------------------------------------------------------------------------------ [Note]s

# A [Note] is a named explanation written once, where the code it explains lives (flexattn/, its
# templates, or a page of docs/); elsewhere "see [Note] Name (in path)" points at it. The history
# (CHANGELOG.md, docs/benchmarks_log.md) quotes notes as they were named then, so it is not checked.
NOTE = re.compile(r"\[Note\]\s*")
_MARKER = re.compile(r'^\s*(?:#+|\{#|//|\*|[rf]?""")?\s*')  # comment or docstring opening
_NAME_END = re.compile(r"\.(?:\s|$)|:|\s\(|\)|\"\"\"|#\}")
_IN_FILE = re.compile(r"^\s*(?:in|,|\()\s*`?((?:[\w./-]+/)?[\w-]+\.(?:py\.jinja|py|jinja|md))")
HISTORY = {"CHANGELOG.md", "docs/benchmarks_log.md", "tests/test_docs.py"}  # and this file's own examples


def _note_files(root: Path) -> list[Path]:
    found = [p for folder in ("flexattn", "docs", "tests", "benchmarks", "examples") if (root / folder).is_dir()
             for p in (root / folder).rglob("*") if p.suffix in (".py", ".jinja", ".md") and "data" not in p.parts]
    return sorted(p for p in found + [root / "README.md"]
                  if p.is_file() and p.relative_to(root).as_posix() not in HISTORY)


def notes(root: Path = ROOT) -> tuple[dict, list]:
    """``({name: [where it is defined]}, [(where, the text after a reference's [Note])])``. A note is
    defined where "[Note] Name" opens a comment, docstring or paragraph in flexattn/ or docs/ (the
    previous line ended a sentence, or was code); its name runs to the first ".", ":" or "(". Every
    other "[Note]" is a reference, read across line breaks and joined string literals."""
    defined, references = {}, []
    for path in _note_files(root):
        where = path.relative_to(root).as_posix()
        raw = path.read_text().splitlines()
        prose = [_MARKER.sub("", line, count=1).rstrip() for line in raw]
        may_define = where.startswith(("flexattn/", "docs/"))
        for i, text in enumerate(prose):
            for match in NOTE.finditer(text):
                previous, code_before = (prose[i - 1], raw[i - 1].lstrip()) if i else ("", "")
                opens = match.start() == 0 and (
                    not previous or previous.endswith((".", ":", '"""'))
                    or path.suffix != ".md" and not code_before.startswith(("#", "{#", "//", "*")))
                rest = text[match.end():]
                if may_define and opens:
                    name = rest[:m.start()] if (m := _NAME_END.search(rest)) else rest
                    defined.setdefault(name.strip().strip("`").strip(), []).append(where)
                else:
                    following = " ".join([rest, *prose[i + 1 : i + 3]])
                    references.append((f"{where}:{i + 1}", " ".join(re.sub(r'"\s*"', "", following).split())))
    return defined, references


def dangling_notes(root: Path = ROOT) -> list[str]:
    defined, references = notes(root)
    names = sorted(defined, key=len, reverse=True)  # the longest name that fits
    problems = []
    for where, text in references:
        text = text.replace("`", "")
        name = next((n for n in names if text.startswith(n.replace("`", ""))
                     and not text[len(n.replace("`", "")) :][:1].isalnum()), None)
        if name is None:
            problems.append(f"{where}: [Note] {text[:60]}... names no note")
            continue
        in_file = _IN_FILE.match(text[len(name.replace("`", "")) :])
        if in_file and not any(f.endswith(in_file.group(1).removeprefix("flexattn/")) for f in defined[name]):
            problems.append(f"{where}: [Note] {name} is not in {in_file.group(1)} (it is in {', '.join(defined[name])})")
    return problems


def test_every_note_referenced_is_defined():
    problems = dangling_notes()
    assert not problems, "references to notes that do not exist (renamed or removed?):\n" + "\n".join(problems)


def test_the_note_check_finds_a_dangling_reference(tmp_path):
    (tmp_path / "flexattn").mkdir()
    (tmp_path / "README.md").write_text("See [Note] Cache keys in `flexattn/a.py` and [Note] Gone.\n")
    (tmp_path / "flexattn" / "a.py").write_text(
        "x = 1\n# [Note] Cache keys. Every cache keys on content.\n"
        "# see [Note] Cache\n# keys, and [Note] Cache keys in b.py\n")
    (tmp_path / "flexattn" / "b.py").write_text('doc = ("a long line ([Note] Cache " "keys, a.py)")\n')
    assert notes(tmp_path)[0] == {"Cache keys": ["flexattn/a.py"]}
    assert [p.split(": ", 1)[1] for p in dangling_notes(tmp_path)] == [
        "[Note] Gone.... names no note", "[Note] Cache keys is not in b.py (it is in flexattn/a.py)"]


def test_ops_the_docs_call_unsupported_are_still_missing_from_the_table():
    # docs/limitations.md and docs/adding_an_op.md name these as ops a mod cannot use yet; when one
    # is added to flexattn/lowering/ops.py, those pages must say so.
    import torch

    from flexattn.lowering.ops import LOWERINGS, lookup

    text = (DOCS / "limitations.md").read_text() + (DOCS / "adding_an_op.md").read_text()
    for name in ("sinh", "cosh", "atan2", "logaddexp", "nan_to_num"):
        assert f"`{name}`" in text or f"aten.{name}" in text, name
        op = getattr(torch.ops.aten, name)
        assert lookup(op.default, LOWERINGS) is None and lookup(op, LOWERINGS) is None, (
            f"aten.{name} is in the lowering table now: update docs/limitations.md and docs/adding_an_op.md"
        )


def test_pages_give_the_decode_kernels_automatic_limit_the_code_uses():
    # issue 19: three pages said 16 rows while decode.MAX_AUTO_QUERY_LEN was 64.
    from flexattn.kernels import MAX_AUTO_QUERY_LEN as n

    def words(page: str) -> str:
        return " ".join((ROOT / page).read_text().split())

    assert f"Short queries (up to {n} rows, no gradient)" in words("README.md")
    assert f"CUDA, at most {n} query rows" in words("docs/architecture.md")
    assert f"chosen automatically for at most {n} query rows" in words("docs/limitations.md")
    # options.py's BACKEND description, through docs/api.md (kept equal to it by the test above)
    assert f"decode kernels for queries of up to {n} rows" in words("docs/api.md")


def test_docs_data_holds_only_what_a_page_cites():
    # Raw run files are evidence for a page's numbers; one that no page names is clutter.
    pages = "".join(p.read_text() for p in [ROOT / "README.md", *DOCS.glob("*.md")])
    uncited = sorted(p.name for p in (DOCS / "data").iterdir() if p.name not in pages)
    assert not uncited, f"docs/data files no page cites (cite them or remove them): {uncited}"
