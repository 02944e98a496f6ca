"""The layout stays easy to see (docs/ARCHITECTURE.md): small functions and modules, no
``# fmt: skip`` (a limit is met by splitting along a seam, not by packing lines), and no
import cycle, neither between modules nor between the packages that stand for layers.

Between modules and layers, module-level imports count (an import inside a function, or under
``TYPE_CHECKING``, runs later, or never); importing ``kvwise.core.kv_spec`` counts as
importing the package ``kvwise.core`` too, which is how a package-level cycle bites. Inside
one package every import counts, ``TYPE_CHECKING`` and function-level ones too: a circle
hidden that way is still a circle to a reader. The deliberate lazy imports are listed by name
(``LAZY``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvwise"
MAX_FUNCTION_LINES = 60
FUNCTION_LIMITED = ("core", "engine", "store", "server", "worker", "models")
MAX_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


# (importer, imported): imports inside a package deliberately made late, and why
LAZY: dict[tuple[str, str], str] = {}


def _imported(node: ast.Import | ast.ImportFrom, package: list[str]) -> set[str]:
    """What one import statement names: modules, and names that may be modules."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = package[: len(package) - node.level + 1] if node.level else []
    module = ".".join(base + ([node.module] if node.module else []))
    return {module} | {f"{module}.{alias.name}" for alias in node.names}


def _module_imports(name: str, path: Path, known: dict[str, Path], every: bool = False) -> set[str]:
    """The kvwise modules ``name`` imports at module level (``every``: anywhere in it)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                found.update(_imported(node, package))

    tree = ast.parse(path.read_text())
    if every:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.update(_imported(node, package))
    else:
        visit(tree.body)
    deps = set()
    for module in found:
        parts = module.split(".")
        # the module and every package above it (their __init__ runs first)
        deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    # NOTE: a module's own packages are initialized before it runs: no edge to them
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    return {d for d in deps if d in known and d not in own}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _module_imports(name, path, known) for name, path in known.items()}


def _layer(module: str) -> str:
    return ".".join(module.split(".")[:2])  # kvwise.core, kvwise.config, ...


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_layers():
    layers: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        layers.setdefault(_layer(module), set()).update(
            _layer(d) for d in deps if _layer(d) != _layer(module)
        )
    assert _cycles(layers) == []


def _child(module: str, package: str) -> str | None:
    """The member of ``package`` (a module or a subpackage) that ``module`` lies in."""
    if not module.startswith(package + "."):
        return None
    return ".".join(module.split(".")[: package.count(".") + 2])


def test_no_import_circle_inside_a_package():
    """Each package's members (modules and subpackages) as nodes, every import counted."""
    known = _modules()
    imports = {n: _module_imports(n, p, known, every=True) for n, p in known.items()}
    packages = {n for n, p in known.items() if p.name == "__init__.py"}
    circles = []
    for package in sorted(packages - {"kvwise"}):  # between layers: module-level imports
        graph: dict[str, set[str]] = {}
        for name, deps in imports.items():
            member = _child(name, package)
            if member is None:
                continue
            for dep in deps:
                other = _child(dep, package)
                if other is not None and other != member and (name, dep) not in LAZY:
                    graph.setdefault(member, set()).add(other)
        circles += _cycles(graph)
    assert circles == []


def test_no_fmt_skip():
    marked = [
        str(path.relative_to(PACKAGE))
        for path in _modules().values()
        if "# fmt: skip" in path.read_text()
    ]
    assert marked == []


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_modules_are_small():
    too_long = {
        str(path.relative_to(PACKAGE)): lines
        for path in _modules().values()
        if "bench" not in path.relative_to(PACKAGE).parts
        and (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert too_long == {}


def test_functions_are_small():
    too_long = {}
    for path in _modules().values():
        if path.relative_to(PACKAGE).parts[0] not in FUNCTION_LIMITED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert too_long == {}


DOCS = PACKAGE.parent / "docs"
MAX_MAP_LINES = 150


def test_the_module_map_fits_a_page_and_every_module_is_described():
    architecture = (DOCS / "ARCHITECTURE.md").read_text()
    start = architecture.index("## Module map")
    end = architecture.index("\n## ", start + 1)
    assert architecture[start:end].count("\n") <= MAX_MAP_LINES
    detailed = (DOCS / "MODULES.md").read_text()
    undescribed = [
        str(path.relative_to(PACKAGE))
        for path in _modules().values()
        if path.name not in ("__init__.py", "__main__.py") and path.name not in detailed
    ]
    assert undescribed == []
