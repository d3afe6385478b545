"""What may import what (DESIGN.md, "What may import what"), checked on the source with `ast`.

Rules, over every module of src/moetier:
- policies/, sim/ and studies/ import no torch and nothing of store/, kernels/, formats/, runtime/, and do not
  reach torch through other moetier modules either (module-level imports, followed transitively);
- store/, kernels/, formats/ and models/ never import runtime/; store/ does not import models/;
- runtime/ never imports serve/, report/ or cli/; nothing outside cli/ imports cli/;
- no import of a moetier module inside a function (imports under `if TYPE_CHECKING:` are allowed);
- no import cycle between modules (the graph of module-level imports, those under TYPE_CHECKING included:
  an annotation-only dependency still couples the modules; any strongly connected component of more than
  one module, or a module importing itself, is a cycle).

Layer rules count every import statement of a file (module level, in functions, under TYPE_CHECKING).
`from pkg import name` depends on the module pkg.name when that module exists, else on pkg. Each violation
names the file, the line and the rule. The checker is tested on small synthetic trees so it provably fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "moetier"

NO_TORCH = ("policies", "sim", "studies")
ENGINE_SIDE = ("store", "kernels", "formats", "runtime")
# (layers that import, layers they must not import, why)
FORBIDDEN: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (NO_TORCH, ENGINE_SIDE, "policies/, sim/ and studies/ import nothing of store/, kernels/, formats/, runtime/"),
    (("store", "kernels", "formats", "models"), ("runtime",),
     "store/, kernels/, formats/ and models/ never import runtime/"),
    (("store",), ("models",), "store/ does not import models/ (it is handed layouts)"),
    (("runtime",), ("serve", "report", "cli"), "runtime/ never imports serve/, report/ or cli/"),
)  # fmt: skip


@dataclass(frozen=True)
class Import:
    target: str  # dotted module name
    line: int
    in_function: bool
    type_checking: bool


@dataclass
class Module:
    name: str  # dotted, e.g. moetier.cli.app (a package: moetier.cli)
    path: Path
    imports: list[Import] = field(default_factory=list)

    @property
    def layer(self) -> str:
        """The subpackage under the root package ('cli', 'runtime', ...), or '' for a top-level module."""
        parts = self.name.split(".")
        is_pkg = self.path.name == "__init__.py"
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_pkg) else ""


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.detail}"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool, type_checking: bool) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node under `node` with (inside a function?, under `if TYPE_CHECKING:`?)."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function, type_checking
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, True, type_checking)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.body:
                yield sub, in_function, True
                yield from _walk(sub, in_function, True)
            for sub in child.orelse:
                yield sub, in_function, type_checking
                yield from _walk(sub, in_function, type_checking)
        else:
            yield from _walk(child, in_function, type_checking)


def _targets(node: ast.Import | ast.ImportFrom, module: Module, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolve against this module's package
        base = module.name.split(".")
        if module.path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join([*base, *([node.module] if node.module else [])])
    else:
        pkg = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{pkg}.{alias.name}"
        out.append(sub if sub in known else pkg)
    return out


def load_modules(src: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of `src/package` with its imports."""
    paths = sorted((src / package).rglob("*.py"))
    modules = {_module_name(p, src): Module(_module_name(p, src), p) for p in paths}
    known = set(modules)
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"), filename=str(mod.path))
        for node, in_function, type_checking in _walk(tree, False, False):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, mod, known):
                    mod.imports.append(Import(target, node.lineno, in_function, type_checking))
    return modules


def _layer_of(target: str, package: str) -> str | None:
    """The layer of an imported module of `package` (None: not ours; '' for a top-level module)."""
    parts = target.split(".")
    if parts[0] != package:
        return None
    return parts[1] if len(parts) > 1 else ""


def layer_violations(modules: dict[str, Module], src: Path, package: str = PACKAGE) -> list[Violation]:
    out = []
    for mod in modules.values():
        rel = mod.path.relative_to(src.parent) if mod.path.is_relative_to(src.parent) else mod.path
        for imp in mod.imports:
            top = imp.target.split(".")[0]
            if mod.layer in NO_TORCH and top == "torch":
                out.append(Violation(rel, imp.line, f"{mod.layer}/ must not import torch", f"imports {imp.target}"))
            layer = _layer_of(imp.target, package)
            if layer is None or layer == mod.layer:
                continue
            for sources, banned, why in FORBIDDEN:
                if mod.layer in sources and layer in banned:
                    out.append(Violation(rel, imp.line, why, f"imports {imp.target}"))
            if layer == "cli":
                out.append(Violation(rel, imp.line, "nothing outside cli/ imports cli/", f"imports {imp.target}"))
        for imp in mod.imports:
            if imp.in_function and not imp.type_checking and _layer_of(imp.target, package) is not None:
                out.append(Violation(rel, imp.line, "no import of a moetier module inside a function",
                                     f"imports {imp.target}"))  # fmt: skip
    return out


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                comps.append(sorted(comp))
    return comps


def cycle_violations(modules: dict[str, Module], src: Path) -> list[Violation]:
    """One violation per module-level import edge inside an import cycle."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for mod in modules.values():
        for imp in mod.imports:
            if not imp.in_function and imp.target in modules:
                graph[mod.name].add(imp.target)
    out = []
    for comp in _sccs(graph):
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph[comp[0]]:
            continue
        for name in comp:
            mod = modules[name]
            rel = mod.path.relative_to(src.parent) if mod.path.is_relative_to(src.parent) else mod.path
            seen: set[str] = set()
            for imp in mod.imports:
                if imp.in_function or imp.target not in members or imp.target in seen:
                    continue
                seen.add(imp.target)
                out.append(Violation(rel, imp.line, f"import cycle among {', '.join(comp)}", f"imports {imp.target}"))
    return out


def torch_reach_violations(modules: dict[str, Module], src: Path) -> list[Violation]:
    """policies/, sim/, studies/ modules whose module-level imports lead to torch through other moetier modules;
    the violation is on the module's own import that starts the chain, and names the chain."""
    graph = {name: [imp for imp in mod.imports if not imp.in_function and not imp.type_checking]
             for name, mod in modules.items()}  # fmt: skip
    out = []
    for mod in modules.values():
        if mod.layer not in NO_TORCH:
            continue
        rel = mod.path.relative_to(src.parent) if mod.path.is_relative_to(src.parent) else mod.path
        for first in graph[mod.name]:
            if first.target not in modules:
                continue  # a direct torch import is layer_violations' (and third-party modules are not followed)
            parent: dict[str, str | None] = {first.target: None}
            queue, chain = [first.target], None
            while queue and chain is None:
                name = queue.pop(0)
                for imp in graph[name]:
                    if imp.target.split(".")[0] == "torch":
                        chain = [imp.target, name]
                        break
                    if imp.target in modules and imp.target not in parent:
                        parent[imp.target] = name
                        queue.append(imp.target)
            if chain is not None:
                while (up := parent[chain[-1]]) is not None:
                    chain.append(up)
                out.append(Violation(rel, first.line, f"{mod.layer}/ must not reach torch",
                                     " -> ".join([mod.name, *reversed(chain)])))  # fmt: skip
    return out


def check_tree(src: Path, package: str = PACKAGE) -> list[Violation]:
    """Every violation of the rules in `src/package`, by file and line."""
    modules = load_modules(src, package)
    found = layer_violations(modules, src, package) + cycle_violations(modules, src)
    found += torch_reach_violations(modules, src)
    return sorted(set(found), key=lambda v: (str(v.path), v.line, v.rule, v.detail))


# -- the real tree ---------------------------------------------------------------------------------------------
def test_source_tree_follows_the_import_rules() -> None:
    violations = check_tree(SRC)
    assert not violations, f"{len(violations)} import rule violation(s):\n" + "\n".join(map(str, violations))


# -- the checker itself, on synthetic trees ------------------------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in (root / "pkg").rglob("*.py")}:
        (folder / "__init__.py").touch()
    return root


CLEAN = {
    "types.py": "X = 1\n",
    "policies/a.py": "from __future__ import annotations\nfrom typing import TYPE_CHECKING\nfrom pkg.types import X\n",
    "runtime/engine.py": "import torch\nfrom pkg.policies.a import X\nfrom pkg.store import pool\n",
    "store/pool.py": "from pkg import types\n",
    "cli/app.py": "from pkg.runtime import engine\nfrom pkg.cli import cmd\n",
    "cli/cmd.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.types import X\n"
                  "def f():\n    import json\n    return json\n",
}  # fmt: skip


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    assert check_tree(_tree(tmp_path, CLEAN), "pkg") == []


@pytest.mark.parametrize(
    ("rel", "text", "rule"),
    [
        ("policies/b.py", "import torch\n", "policies/ must not import torch"),
        ("sim/m.py", "from torch import nn\n", "sim/ must not import torch"),
        ("studies/s.py", "def f():\n    import torch.nn\n", "studies/ must not import torch"),
        ("sim/m.py", "from pkg import helper\n", "sim/ must not reach torch"),
        ("sim/m.py", "from pkg.store.pool import X\n", "import nothing of store/"),
        ("studies/s.py", "from pkg.kernels import k\n", "import nothing of store/"),
        ("policies/b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.runtime import engine\n",
         "import nothing of store/"),
        ("store/x.py", "from pkg.runtime.engine import E\n", "never import runtime/"),
        ("models/m.py", "import pkg.runtime.engine\n", "never import runtime/"),
        ("formats/f.py", "from ..runtime import engine\n", "never import runtime/"),
        ("store/x.py", "from pkg.models import m\n", "store/ does not import models/"),
        ("runtime/r.py", "from pkg.serve import app\n", "runtime/ never imports serve/"),
        ("runtime/r.py", "from pkg.report.x import y\n", "runtime/ never imports serve/"),
        ("serve/s.py", "from pkg.cli.app import main\n", "nothing outside cli/ imports cli/"),
        ("config.py", "import pkg.cli\n", "nothing outside cli/ imports cli/"),
        ("cli/c.py", "def f():\n    from pkg.types import X\n    return X\n", "inside a function"),
        ("types2.py", "class A:\n    def m(self):\n        from . import types\n", "inside a function"),
        ("a.py", "from pkg import b\n", "import cycle among pkg.a, pkg.b"),
        ("self.py", "import pkg.self\n", "import cycle among pkg.self"),
    ],
)  # fmt: skip
def test_checker_finds_each_rule(tmp_path: Path, rel: str, text: str, rule: str) -> None:
    files = {**CLEAN, rel: text}
    if rel == "sim/m.py" and "helper" in text:
        files["helper.py"] = "from pkg import deep\n"
        files["deep.py"] = "import torch\n"
    if rel == "a.py":
        files["b.py"] = "from __future__ import annotations\nfrom pkg.c import y\n"
        files["c.py"] = "import pkg.a\n"
    found = check_tree(_tree(tmp_path, files), "pkg")
    assert found, f"no violation found for {rel}"
    hits = [v for v in found if rule in v.rule]
    assert hits, [str(v) for v in found]
    assert any(str(v.path).endswith(rel) and v.line >= 1 for v in hits), [str(v) for v in hits]
    assert all(f"{v.path}:{v.line}: " in str(v) for v in found)  # file, line and rule in every message


def test_checker_reports_every_edge_of_a_cycle_including_type_checking_ones(tmp_path: Path) -> None:
    files = {**CLEAN, "a.py": "import pkg.b\n", "b.py": "\n\nfrom pkg import a\n",
             "c.py": "def f():\n    import pkg.a\n", "d.py": "from typing import TYPE_CHECKING\n"
             "if TYPE_CHECKING:\n    import pkg.a\n", "e.py": "import pkg.d\n"}  # fmt: skip
    files["a.py"] += "import pkg.c\nimport pkg.e\n"
    found = check_tree(_tree(tmp_path, files), "pkg")
    cycles = sorted((str(v.path).split("pkg/")[-1], v.line) for v in found if "cycle" in v.rule)
    # a <-> b; a -> e -> d -(TYPE_CHECKING)-> a is a cycle too; c's import inside a function is its own violation
    assert cycles == [("a.py", 1), ("a.py", 3), ("b.py", 3), ("d.py", 3), ("e.py", 1)]
    assert [str(v.path).split("pkg/")[-1] for v in found if "inside a function" in v.rule] == ["c.py"]
