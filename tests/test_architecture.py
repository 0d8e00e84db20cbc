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


# ----------------------------------------------------------------------------- layers
# The layers, lowest first: (name, its one job, its modules and packages). A module may import its own
# layer and the ones below, never one above (function-local imports included). Every module of kl_bench
# belongs to exactly one layer (a package entry covers its submodules unless a submodule is listed
# elsewhere): a new module must be placed here, or this test fails. README's Architecture section
# shows the same table.
LAYERS = [
    ("foundation", "errors, registries, typed TOML tables, safe file I/O, atomic storage, signals, formatting, "
     "progress, figure styles and report pages",
     ["errors", "registry", "config", "safe_io", "storage", "signals", "progress", "threads", "formatting",
      "version", "figstyle", "pages"]),
    ("maths", "estimators, targets, clamps and presets, gradient modes, weight corrections, rejection masks, "
     "aggregates, exact oracles, statistics",
     ["estimators", "targets", "presets", "modes", "weights", "rejection", "aggregates", "draws", "oracles", "rollout_dp",
      "topk", "precision", "stats", "planning"]),
    ("sampling", "logits sources, samplers (the mismatch options), seeds, alias tables, multinomial count vectors",
     ["logits", "samplers", "seeding", "alias", "multinomial"]),
    ("kinds", "one module or package per case kind and its protocols (kl_bench/pairs)", ["pairs"]),
    ("engine", "seeded batches, feature sums, the gradient pass, torchrun ranks", ["engine", "distributed"]),
    ("results", "the stored tables: schemas, the CSV reader and writer, verification, summary rows",
     ["results"]),
    ("experiment", "a spec end to end: parsing, pilot, main pass, λ sweep, gradient and baseline rows",
     ["spec", "experiment", "lambdas", "gradients", "baselines"]),
    ("applications", "training trajectories and the trainer audit", ["training", "audit"]),
    ("analysis", "the regression gate and the advice (what to log, what to put in the loss)", ["gate", "advice"]),
    ("presentation", "terminal tables, figures, the report", ["display", "plots", "report"]),
    ("interfaces", "the Python API, runs written to folders, the CLI, the TRL callback",
     ["kl_bench", "api", "estimation", "runner", "cli", "__main__", "_testing", "integrations"]),
]


def _layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest entry that is ``module`` or a package holding it."""
    best, index = -1, None
    for i, (_, _, entries) in enumerate(LAYERS):
        for entry in entries:
            full = "kl_bench" if entry == "kl_bench" else f"kl_bench.{entry}"
            inside = module.startswith(full + ".") and entry != "kl_bench"   # the top package: itself only
            if (module == full or inside) and len(full) > best:
                best, index = len(full), i
    return index


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers():
    graph = _imports(_modules())
    unplaced = sorted(m for m in graph if _layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    up = [f"{m} ({LAYERS[_layer_of(m)][0]}) imports {t} ({LAYERS[_layer_of(t)][0]})"
          for m, targets in sorted(graph.items()) for t in sorted(targets) if _layer_of(t) > _layer_of(m)]
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_the_layer_table_can_fail():
    assert _layer_of("kl_bench.pairs.rollout.pair") == 3 and _layer_of("kl_bench.results.verify") == 5
    assert _layer_of("kl_bench.nowhere") is None and _layer_of("kl_bench") == len(LAYERS) - 1


def test_the_readme_shows_the_layer_table():
    readme = (PKG.parent / "README.md").read_text()
    for name, job, _ in LAYERS:
        assert f"| {name} | {job} |" in readme, name


def test_reading_reporting_and_gating_results_load_no_engine_kind_or_sampler():
    """`kl-bench report` and `check --results` read folders: they must not load the machinery that wrote
    them (the engine, a case kind, a sampler, the spec parser, the summary-row builder)."""
    code = ("import sys, kl_bench.report, kl_bench.gate, kl_bench.results.verify, kl_bench.advice; "
            "print('\\n'.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=PKG.parent).stdout.split())
    forbidden = ("kl_bench.engine", "kl_bench.pairs", "kl_bench.samplers", "kl_bench.spec", "kl_bench.experiment",
                 "kl_bench.results.rows", "kl_bench.distributed", "kl_bench.logits")
    assert "kl_bench.report" in loaded
    assert not [m for m in loaded if m.startswith(forbidden)], [m for m in loaded if m.startswith(forbidden)]
