"""The library's layers point down: no import cycle among xelink's modules (imports inside functions
included), nothing outside the benchmark suite imports it, and ``xelink.init()`` loads none of it."""
import ast
import subprocess
import sys
from pathlib import Path

import xelink

ROOT = Path(xelink.__file__).resolve().parent
# The command line sits above everything: it runs the suite (``xelink bench``), so it may import it.
ABOVE_THE_LIBRARY = ("xelink.bench", "xelink.cli", "xelink.__main__")


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(name: str, path: Path, known) -> set:
    """Every xelink module ``name`` imports, anywhere in the file (function bodies included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()

    def nearest(target: str):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("xelink"):
                    nearest(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if not module.startswith("xelink"):
                continue
            for alias in node.names:
                nearest(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            arg = node.args[0]  # importlib.import_module("x.y") or f".bench.{name}" (its constant head)
            head = ""
            if isinstance(arg, ast.Constant):
                head = arg.value
            elif isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
                head = arg.values[0].value
            if isinstance(head, str) and head.startswith("."):
                head = f"{package}{head}"
            if isinstance(head, str) and head.startswith("xelink"):
                nearest(head.rstrip("."))
    return found


def _graph() -> dict:
    known = _modules()
    return {name: _edges(name, path, known) for name, path in known.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_inside_functions_and_dynamic_ones(tmp_path):
    source = ("import importlib\n\ndef f(name):\n    from .bench import suite\n    import xelink.tuning\n"
              "    return importlib.import_module(f'.bench.{name}', __package__)\n")
    path = tmp_path / "mod.py"
    path.write_text(source)
    known = {"xelink", "xelink.bench", "xelink.bench.suite", "xelink.tuning", "xelink.mod"}
    assert _edges("xelink.mod", path, known) == {"xelink.bench", "xelink.bench.suite", "xelink.tuning"}
    graph = _graph()
    assert "xelink.collectives.registry" in graph["xelink.collectives.cpu"]  # a module-level relative import
    assert "xelink.collectives.gpu.kernels" in graph["xelink.collectives.gpu.launch"]  # one inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles among xelink's modules: {cycles}"


def test_the_library_does_not_import_the_benchmark_suite():
    bad = {(m, t) for m, targets in _graph().items() if not m.startswith(ABOVE_THE_LIBRARY)
           for t in targets if t.startswith("xelink.bench")}
    assert not bad, f"library modules importing the suite: {sorted(bad)}"
    # The command line hands ``xelink bench ...`` to the suite's own command line, and takes nothing else of it.
    assert {t for t in _graph()["xelink.cli"] if t.startswith("xelink.bench")} == {"xelink.bench.cli"}


def test_init_loads_no_benchmark_module():
    code = ("import sys, xelink; xelink.init(); loaded = sorted(m for m in sys.modules if m.startswith('xelink.bench')); "
            "xelink.finalize(); print(loaded); sys.exit(1 if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


COMPOSED = ("xelink.dist", "xelink.models")
# What a composed op may build on: the public names of these layers (and the communicator), no more.
# The cost model and the layouts are plain functions below every op (the collectives' dispatch reads the
# model too); composed ops take their algorithm choices from them.
BELOW_COMPOSED = ("xelink.symm", "xelink.collectives", "xelink.kernels", "xelink.comm", "xelink.errors", "xelink.cost",
                  "xelink.layout", "xelink.config")  # config: the leaf of knobs every layer reads


def test_composed_ops_import_only_public_names_of_the_layers_below():
    known = _modules()
    bad = []
    for name, path in known.items():
        if not name.startswith(COMPOSED):
            continue
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        own = ".".join(name.split(".")[:2])  # xelink.dist, xelink.models
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("xelink")):
                if node.level:
                    base = package.split(".")
                    base = ".".join(base[: len(base) - (node.level - 1)])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module
                if module == own or module.startswith(own + "."):
                    continue
                targets = [(module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [(a.name, "") for a in node.names if a.name.startswith("xelink")]
            else:
                continue
            for module, item in targets:
                where = f"{name}: from {module} import {item}"
                if not module.startswith(BELOW_COMPOSED) and module != "xelink":
                    bad.append(f"{where} (not a layer below the composed ops)")
                elif any(part.startswith("_") for part in module.split(".") + [item]):
                    bad.append(f"{where} (a private name)")
    assert not bad, "composed ops reach past the public layers: " + "; ".join(bad)
