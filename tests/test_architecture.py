"""The shape of the code, checked statically: imports point one way (no cycles, function-local imports
included), nothing outside kl_bench/pairs/ asks a pair its type, and no module reads another module's
private names. Also: `import kl_bench` has no global side effects and stays fast."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kl_bench"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Intra-package imports of every module, wherever they are written (TYPE_CHECKING blocks excluded)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set()
        for node in ast.walk(tree):       # `if TYPE_CHECKING:` imports never run
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                skip |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = _resolve(mod, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[mod] |= {t for t in targets if t in mods and t != mod}
    return graph


def test_no_import_cycles_including_function_local_imports():
    mods = _modules()
    graph = _imports(mods)
    # A package's __init__ re-exports its submodules (an edge down); a submodule importing its parent
    # package is the cycle to avoid. Report every cycle found.
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" → ".join(c) for c in cycles)


def test_pairs_import_nothing_above_them():
    graph = _imports(_modules())
    above = {"kl_bench.spec", "kl_bench.engine", "kl_bench.gradients", "kl_bench.experiment", "kl_bench.api",
             "kl_bench.cli", "kl_bench.results", "kl_bench.report", "kl_bench.gate", "kl_bench"}
    bad = {m: graph[m] & above for m in graph if m.startswith("kl_bench.pairs") and graph[m] & above}
    assert not bad, bad


def test_nothing_outside_pairs_asks_a_pair_its_type():
    bad = []
    for mod, path in _modules().items():
        if mod.startswith("kl_bench.pairs"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = [n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)]
                names += [n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)]
                if any(n.endswith(("Pair", "Case")) for n in names):
                    bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Compare) and "kind" in ast.unparse(node.left) and any(
                    isinstance(c, ast.Constant) and c.value in ("gaussian", "categorical", "rollout")
                    for c in node.comparators):
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_no_module_reads_another_modules_private_names():
    mods = _modules()
    defined: dict[str, set[str]] = {}
    for mod, path in mods.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        defined[mod] = names
    bad = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{mod}:{node.lineno}: imports {a.name}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if node.attr not in defined[mod]:
                    bad.append(f"{mod}:{node.lineno}: reads {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_import_is_side_effect_free():
    code = ("import matplotlib, sys; before = dict(matplotlib.rcParams); backend = matplotlib.get_backend(); "
            "import kl_bench, kl_bench.plots, kl_bench.report; "
            "assert dict(matplotlib.rcParams) == before and matplotlib.get_backend() == backend; "
            "heavy = [m for m in ('pandas', 'scipy', 'seaborn', 'matplotlib.pyplot') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code = ("import sys, kl_bench; kl_bench.run, kl_bench.ESTIMATORS, kl_bench.check; "
            "print([m for m in ('pandas', 'scipy', 'seaborn', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
    # the package itself is instant: the CLI installs its signal handlers before torch loads
    code = "import sys, kl_bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
