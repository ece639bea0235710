"""Layers point down: no module of the library imports the benchmark suite (xelink.bench), function-level
imports included. The one exception is the command line's front door (xelink/cli.py), which hands
``xelink bench ...`` to the suite's own command line (xelink.bench.cli) and imports nothing else of it."""
import ast
from pathlib import Path

import xelink

PACKAGE = Path(xelink.__file__).parent


def _package_of(path: Path) -> list[str]:
    """The package a module file belongs to, as name parts (``xelink/kernels/gemv.py`` -> xelink, kernels)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return parts[:-1]


def _imports(source: str, package: list[str]) -> set[str]:
    """Every module a source imports (absolute names; relative imports resolved against ``package``), at any
    depth, and the names given to ``importlib.import_module`` (f-strings as written, relative ones as is)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant):
                found.add(str(arg.value))
            elif isinstance(arg, ast.JoinedStr):
                found.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values))
    return found


def _reaches_bench(name: str) -> bool:
    return name == "xelink.bench" or name.startswith("xelink.bench.") or name.startswith(".bench")


def test_no_module_outside_bench_imports_the_suite():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("bench/"):
            continue
        bad = sorted(n for n in _imports(path.read_text(), _package_of(path)) if _reaches_bench(n))
        if bad:
            offenders[rel] = bad
    assert offenders == {"cli.py": ["xelink.bench.cli", "xelink.bench.cli.main"]}, offenders


def test_the_check_sees_function_level_relative_and_dynamic_imports():
    # The old front door's dispatch: function-level, relative, and through importlib with an f-string.
    source = ("import importlib\n\ndef f(name):\n    from .bench import suite\n    import xelink.bench.harness\n"
              "    return importlib.import_module(f'.bench.{name}', __package__)\n")
    got = {n for n in _imports(source, ["xelink"]) if _reaches_bench(n)}
    assert got == {"xelink.bench", "xelink.bench.suite", "xelink.bench.harness", ".bench.{}"}
    assert not {n for n in _imports("from .kernels import gemv\nimport xelink.tuning\n", ["xelink", "models"])
                if _reaches_bench(n)}
