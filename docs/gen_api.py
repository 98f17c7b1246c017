"""Write docs/api.md from the public docstrings, so the reference says what the code says.

    python docs/gen_api.py           # rewrite docs/api.md
    python docs/gen_api.py --check   # exit 1 if docs/api.md differs from a fresh generation

What is covered: every name in ``flexattn.__all__``, every name in ``flexattn.variants.__all__``,
and the entries of ``flexattn.variants.CATALOGUE`` (through the ``Variant`` fields only, so entries
added later appear without a change here). tests/test_docs.py runs the check.

The output must not depend on the machine: signatures are formatted here (a function used as a
default value prints as its name, never as ``<function ... at 0x...>``), and docstrings are printed
as written, in text blocks (they use reST markup, which Markdown would misread). Signatures are text
blocks too: they are not code that runs, and tests/test_doc_examples.py runs every python block.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"

HEADER = """\
# API reference

Generated from the docstrings by `python docs/gen_api.py` (do not edit by hand;
`tests/test_docs.py` fails when this file and the code disagree). The public API is a drop-in for
`torch.nn.attention.flex_attention`: same names, signatures and semantics. How the pieces fit:
[architecture.md](architecture.md); the variant catalogue: [adding_a_variant.md](adding_a_variant.md).
"""


def _annotation(ann) -> str:
    if isinstance(ann, str):
        return ann
    if isinstance(ann, typing.ForwardRef):
        return ann.__forward_arg__
    if isinstance(ann, type):
        return ann.__name__
    return str(ann).replace("typing.", "")


def _default(value) -> str:
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__  # never a repr with an address
    return repr(value)


def signature(obj, name: str) -> str | None:
    """``name(param: type = default, ...) -> type``, or None where Python has no signature."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parts = []
    seen_kw_only = False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not seen_kw_only:
            parts.append("*")
            seen_kw_only = True
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, seen_kw_only = "*" + p.name, True
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}" if p.annotation is not p.empty else f"={_default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    result = f"{name}({', '.join(parts)})"
    if sig.return_annotation is not sig.empty and sig.return_annotation is not None:
        result += f" -> {_annotation(sig.return_annotation)}"
    return result


def _doc_block(obj) -> list[str]:
    doc = inspect.getdoc(obj)
    if not doc:
        return ["*(no docstring)*", ""]
    return ["```text", doc, "```", ""]


def _own_public_members(cls) -> list[tuple[str, object]]:
    """Methods and properties the class itself defines (not tuple's ``count`` or dict's ``get``)."""
    members = []
    for attr, raw in vars(cls).items():
        if attr.startswith("_"):
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            members.append((attr, raw.__func__))
        elif isinstance(raw, property):
            members.append((attr, raw))
        elif inspect.isfunction(raw):
            members.append((attr, raw))
    return members


def _entry(module_name: str, name: str, obj, aliases: dict) -> list[str]:
    out = [f"### `{module_name}.{name}`", ""]
    if name in aliases:
        out += [f"Another name for [`{aliases[name]}`](#{_anchor(module_name, aliases[name])}) "
                "(the FlexAttention paper's spelling).", ""]
        return out
    if inspect.isclass(obj):
        sig = signature(obj, name)
        kind = "exception" if issubclass(obj, BaseException) else "class"
        out += [f"*{kind}*", ""]
        if sig and not typing.is_typeddict(obj):
            out += ["```text", sig, "```", ""]
        out += _doc_block(obj)
        for attr, member in _own_public_members(obj):
            if isinstance(member, property):
                out += [f"#### `{name}.{attr}` (property)", ""] + _doc_block(member)
                continue
            out += [f"#### `{name}.{attr}`", "", "```text", signature(member, attr) or attr, "```", ""]
            out += _doc_block(member)
        return out
    if callable(obj):
        out += ["```text", signature(obj, name) or name, "```", ""] + _doc_block(obj)
        return out
    if isinstance(obj, dict):
        out += [f"*a dict of {len(obj)} entries; see the table below*", ""]
        return out
    out += [f"`{_value(obj)}`", ""]
    return out


def _value(obj) -> str:
    # Modules by name: their repr holds the checkout's path, which differs from machine to machine.
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(_value(o) for o in obj)
        return f"({inner}{',' if len(obj) == 1 else ''})" if isinstance(obj, tuple) else f"[{inner}]"
    return repr(obj)


def _anchor(module_name: str, name: str) -> str:
    # GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces to -.
    text = f"{module_name}.{name}".lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def _aliases(module) -> dict[str, str]:
    """Names in ``__all__`` bound to the same object as an earlier, canonical name."""
    names = list(module.__all__)
    canonical: dict[int, str] = {}
    aliases = {}
    # The canonical name is the one the object calls itself, else the first listed.
    for name in names:
        obj = getattr(module, name)
        if getattr(obj, "__name__", None) == name:
            canonical.setdefault(id(obj), name)
    for name in names:
        obj = getattr(module, name)
        first = canonical.setdefault(id(obj), name)
        if first != name:
            aliases[name] = first
    return aliases


def _section(module, title: str) -> list[str]:
    aliases = _aliases(module)
    out = [f"## {title}", ""]
    out += [f"- [`{module.__name__}.{n}`](#{_anchor(module.__name__, n)})" for n in module.__all__] + [""]
    for name in module.__all__:
        out += _entry(module.__name__, name, getattr(module, name), aliases)
    return out


def _catalogue_table(variants) -> list[str]:
    fields = ["family", "square_only", "decode", "paper"]
    out = ["## The catalogue (`flexattn.variants.CATALOGUE`)", "",
           "Each entry is a `Variant`; `Variant.make(B, H, Q_LEN, KV_LEN, device)` builds an `Instance`.", "",
           "| name | summary | " + " | ".join(fields) + " | tags |",
           "|---|---|" + "---|" * len(fields) + "---|"]
    for name, v in variants.CATALOGUE.items():
        cells = [f"`{name}`", v.summary.replace("|", "\\|")]
        cells += [str(getattr(v, f, "")) for f in fields]
        cells.append(", ".join(sorted(getattr(v, "tags", ()) or ())) or "")
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def render() -> str:
    sys.path.insert(0, str(ROOT))
    import flexattn
    import flexattn.variants as variants

    lines = [HEADER]
    lines += _section(flexattn, "`flexattn`")
    lines += _section(variants, "`flexattn.variants`")
    lines += _catalogue_table(variants)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if API_MD.read_text() != text:
            print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    API_MD.write_text(text)
    print(f"wrote {API_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
