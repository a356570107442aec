"""The library's import arrows (an AST scan of every module in tts_engine/, serving/, server/, ui/ and app.py, imports
inside functions included, `if TYPE_CHECKING:` blocks left out): nothing imports the benchmarks (bench/) or the tests
(tests/), and no two library modules import each other, directly or around a circle (Tarjan's strongly connected
components; a failure names the circle, file and line of each arrow)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tts_engine", "serving", "server", "ui")
SCRIPTS = ("app.py",)
OUTSIDE = ("bench", "tests")


def library_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of the library (a package's __init__.py under the package's own name)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    for script in SCRIPTS:
        if (root / script).exists():
            out[Path(script).stem] = root / script
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks (not imported at run time)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """[(imported module, line)] of every import statement in `path` (module `module`), at any depth. `from P import
    name` is an arrow to P.name where that is a module, else to P; relative imports are resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                full = f"{source}.{a.name}"
                out.append((full if full in known else source, node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) \
                == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            out.append((node.args[0].value, node.lineno))
    return out


def import_graph(root: Path = ROOT) -> tuple[dict[str, dict[str, int]], list[str]]:
    """({module: {library module it imports: first line}}, ["file:line: imports X" for each arrow to bench/tests])."""
    mods = library_modules(root)
    known = set(mods)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    outside = []
    for m, path in mods.items():
        for target, line in imports(m, path, known):
            top = target.split(".")[0]
            if top in OUTSIDE:
                outside.append(f"{path.relative_to(root)}:{line}: imports {target}")
            elif target in known and target != m:
                graph[m].setdefault(target, line)
    return graph, outside


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def a_circle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """One circle through the component's first module (shortest, by breadth-first search inside the component)."""
    inside, start = set(comp), comp[0]
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in graph[v]:
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w in inside and w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def describe(graph: dict[str, dict[str, int]], circle: list[str], mods: dict[str, Path], root: Path = ROOT) -> str:
    return " -> ".join(circle) + "\n" + "\n".join(
        f"    {mods[a].relative_to(root)}:{graph[a][b]}: {a} imports {b}" for a, b in zip(circle, circle[1:]))


def test_the_library_imports_neither_the_benchmarks_nor_the_tests():
    _, outside = import_graph()
    assert not outside, "the library must not import bench/ or tests/:\n" + "\n".join(outside)


def test_no_import_cycle_among_library_modules():
    graph, _ = import_graph()
    mods = library_modules()
    circles = [describe(graph, a_circle(graph, c), mods) for c in strongly_connected(graph)]
    assert not circles, "import cycles among library modules:\n" + "\n".join(circles)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_scan_finds_a_circle_through_a_function_level_import_and_an_arrow_to_bench(tmp_path):
    _write(tmp_path, {
        "tts_engine/__init__.py": "",
        "tts_engine/a.py": "from tts_engine import b\n",
        "tts_engine/b.py": "def f():\n    from .c import g\n",
        "tts_engine/c.py": "import tts_engine.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tts_engine.d\n",
        "tts_engine/d.py": "import tts_engine.c\n",
        "serving/__init__.py": "",
        "serving/x.py": "def f():\n    from bench.common import PlainRead\n",
        "server/__init__.py": "", "ui/__init__.py": "",
        "app.py": "import importlib\nimportlib.import_module('tests.live_server')\n",
    })
    graph, outside = import_graph(tmp_path)
    assert sorted(outside) == ["app.py:2: imports tests.live_server", "serving/x.py:2: imports bench.common"]
    comps = strongly_connected(graph)
    assert comps == [["tts_engine.a", "tts_engine.b", "tts_engine.c"]]   # (c -> d only under TYPE_CHECKING)
    circle = a_circle(graph, comps[0])
    assert circle == ["tts_engine.a", "tts_engine.b", "tts_engine.c", "tts_engine.a"]
    assert "tts_engine/b.py:2: tts_engine.b imports tts_engine.c" in describe(graph, circle, library_modules(tmp_path),
                                                                               tmp_path)
    assert graph["tts_engine.b"] == {"tts_engine.c": 2}


def test_a_package_importing_its_own_modules_is_no_circle(tmp_path):
    _write(tmp_path, {
        "tts_engine/__init__.py": "from tts_engine.engine import run\n",
        "tts_engine/engine.py": "from tts_engine.errors import E\ndef run(): pass\n",
        "tts_engine/errors.py": "class E(Exception): pass\n",
        "serving/__init__.py": "", "server/__init__.py": "", "ui/__init__.py": "",
    })
    graph, outside = import_graph(tmp_path)
    assert not outside and strongly_connected(graph) == []
    assert graph["tts_engine"] == {"tts_engine.engine": 1}
