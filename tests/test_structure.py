"""The package's structure stays as designed: imports run one way (no cycle, counting the imports
made inside functions too), no module takes a private name from another package, the package never
imports the lab (benchmarks/), no module is over 1000 lines and no hand-written signature takes over
14 parameters. Each check has a test that shows it can fail.

docs/architecture.md draws the layers these tests keep apart.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flexattn"


def _modules() -> dict:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict):
    """(imported module, imported name or None) for every import in the file, function-level ones
    included. ``from . import x`` names module x when x is a module, else the package."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield (submodule, None) if submodule in modules else (target, alias.name)


def _packages_above(name: str) -> list:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph(modules: dict) -> dict:
    """Module -> the modules its imports run. Importing ``a.b.c`` first runs the package ``a.b``'s
    ``__init__``, unless the importer is inside ``a.b`` (then it is running already): that import
    is an edge to ``a.b`` too, so a package whose ``__init__`` imports back is a cycle."""
    edges = {}
    for name, path in modules.items():
        for target, _ in _imports(name, path, modules):
            for reached in [target, *_packages_above(target)]:
                if reached in modules and reached != name and reached not in _packages_above(name):
                    edges.setdefault(name, set()).add(reached)
    return edges


def _cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    # The test above can fail: two modules that import each other are one component.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_importing_a_module_runs_its_package_first(tmp_path):
    # pkg.x imports pkg.sub.y, whose package's __init__ imports pkg.x back: a cycle through an
    # __init__ that no import names. Inside pkg.sub, importing a sibling runs no __init__ again.
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {"pkg/__init__.py": "", "pkg/x.py": "from .sub.y import f\n", "pkg/sub/__init__.py": "from .. import x\n",
             "pkg/sub/y.py": "from .z import g\n", "pkg/sub/z.py": "g = 1\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    modules = {".".join(Path(n).with_suffix("").parts).removesuffix(".__init__"): tmp_path / n for n in files}
    edges = _graph(modules)
    assert _cycles(edges) == [["pkg.sub", "pkg.x"]]
    assert "pkg.sub" not in edges["pkg.sub.y"]


def test_no_private_names_taken_from_another_package():
    modules = _modules()
    taken = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target, attr in _imports(name, path, modules):
            if not attr or not attr.startswith("_") or attr.startswith("__") or target not in modules:
                continue
            owner = target if modules[target].name == "__init__.py" else target.rpartition(".")[0]
            if owner == "flexattn" or not (package == owner or package.startswith(owner + ".")):
                taken.append(f"{name} takes {attr} from {target}")
    assert not taken, "; ".join(taken)


def test_the_layers_import_downward():
    # The pipeline's stages, lowest first: a module may import its own layer and those below.
    layers = [
        {"flexattn.errors", "flexattn.options", "flexattn.cuda_graphs", "flexattn.mods", "flexattn.trace"},
        {"flexattn.lowering", "flexattn.reference", "flexattn.blockwise"},
        {"flexattn.masks", "flexattn.paged_attention", "flexattn.codegen"},
        {"flexattn.kernels"},
        {"flexattn.dispatch"},
        {"flexattn.request"},
        {"flexattn.autograd", "flexattn.compile"},
        {"flexattn.api"},
    ]

    def layer_of(module):
        for i, layer in enumerate(layers):
            if any(module == top or module.startswith(top + ".") for top in layer):
                return i
        return None

    modules = _modules()
    upward = []
    for name, targets in _graph(modules).items():
        mine = layer_of(name)
        if mine is None:
            continue
        for target in targets:
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that run up the pipeline: " + ", ".join(sorted(upward))


LAB = "benchmarks"  # the checkout's lab (benchmarks/): not installed, so the package must never need it


def _lab_uses(path: Path) -> list:
    """Where a file imports the lab, or names one of its modules in a string (importlib.import_module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.isidentifier() or "." in node.value and " " not in node.value else []
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if name == LAB or name.startswith(LAB + ".")]
    return found


def test_the_package_does_not_import_the_lab():
    uses = [f"{name} ({use})" for name, path in _modules().items() for use in _lab_uses(path)]
    assert not uses, "flexattn modules that need the checkout's benchmarks/: " + "; ".join(uses)


def test_the_lab_check_finds_an_import_of_the_lab(tmp_path):
    # The test above can fail: an import, a from-import and a module name in a string all count.
    module = tmp_path / "m.py"
    module.write_text("import benchmarks.sweep\nfrom benchmarks import targets\n"
                      "importlib.import_module('benchmarks.startup')\nx = 'benchmarks are fun'\n")
    assert [use.split(": ")[1] for use in _lab_uses(module)] == ["benchmarks.sweep", "benchmarks",
                                                                  "benchmarks.startup"]


MAX_LINES = 1000  # a module longer than this holds more than one idea: split it along its seams
MAX_PARAMETERS = 14  # a wider signature wants its arguments bundled (a NamedTuple, a record)


def _long_modules(root: Path) -> list:
    """``path lines`` of every module under ``root`` longer than MAX_LINES."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            found.append(f"{path.relative_to(root.parent).as_posix()} {lines}")
    return found


def _parameters(args: ast.arguments) -> int:
    """Positional and keyword parameters, with *args and **kwargs one each."""
    return (len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + (args.vararg is not None)
            + (args.kwarg is not None))


def _wide_signatures(root: Path) -> dict:
    """``path:qualified name`` -> parameters, for every def under ``root`` wider than MAX_PARAMETERS.
    Hand-written Python only: the templates (templates/*.jinja) are not .py files."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()

        def visit(node, outer):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = outer + child.name
                    if not isinstance(child, ast.ClassDef) and _parameters(child.args) > MAX_PARAMETERS:
                        found[f"{where}:{name}"] = _parameters(child.args)
                    visit(child, name + ".")
                else:
                    visit(child, outer)

        visit(ast.parse(path.read_text()), "")
    return found




def test_no_module_over_the_line_limit():
    long = _long_modules(PACKAGE)
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): " + ", ".join(long)


def test_the_line_check_finds_a_long_module(tmp_path):
    # The test above can fail: one line over the limit counts, the limit itself does not.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert _long_modules(package) == [f"pkg/sub/long.py {MAX_LINES + 1}"]


def test_no_signature_over_the_parameter_limit():
    wide = _wide_signatures(PACKAGE)
    assert not wide, f"signatures over {MAX_PARAMETERS} parameters (bundle them): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(wide.items()))


def test_the_signature_check_finds_a_wide_signature(tmp_path):
    # The test above can fail: every def counts, methods and nested functions included, with
    # keyword-only parameters and *args / **kwargs (one each); a class is not a signature.
    package = tmp_path / "pkg"
    package.mkdir()
    twelve = ", ".join(f"a{i}" for i in range(12))
    (package / "m.py").write_text(
        f"def fine({twelve}, *args, **kwargs): pass\n"
        f"class Op:\n"
        f"    def wide(self, {twelve}, *, b, c): pass\n"
        f"    async def fine(self, {twelve}, b): pass\n"
        f"def outer():\n"
        f"    def inner({twelve}, *args, b, **kwargs): pass\n"
    )
    assert _wide_signatures(package) == {"pkg/m.py:Op.wide": 15, "pkg/m.py:outer.inner": 15}
