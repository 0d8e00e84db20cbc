"""The shape of the code, checked statically: imports point one way (no cycles, function-local imports
included), nothing outside kl_bench/kinds/ asks a pair its type, and no module reads another module's
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


def _imports(mods: dict[str, Path], type_checking: bool = False) -> dict[str, set[str]]:
    """Intra-package imports of every module, wherever they are written (TYPE_CHECKING blocks excluded unless
    ``type_checking``)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set()
        for node in ast.walk(tree):       # `if TYPE_CHECKING:` imports never run
            if not type_checking and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
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


def test_no_import_cycles_including_function_local_and_type_only_imports():
    mods = _modules()
    graph = _imports(mods, type_checking=True)     # a type-only import in a circle is a circle all the same
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


def test_nothing_outside_kinds_asks_a_pair_its_type():
    bad = []
    for mod, path in _modules().items():
        if mod.startswith("kl_bench.kinds"):
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
    """One fresh interpreter, in three steps (one start-up of Python instead of three): the package itself is
    instant (the CLI installs its signal handlers before torch loads); the API's run, estimators and check load
    no pandas, scipy, seaborn or matplotlib; importing the plots and the report leaves matplotlib's rcParams and
    backend as they were."""
    code = ("import sys, kl_bench; assert 'torch' not in sys.modules, 'torch'; "
            "kl_bench.run, kl_bench.ESTIMATORS, kl_bench.check; "
            "heavy = [m for m in ('pandas', 'scipy', 'seaborn', 'matplotlib') if m in sys.modules]; "
            "assert not heavy, heavy; "
            "import matplotlib; before = dict(matplotlib.rcParams); backend = matplotlib.get_backend(); "
            "import kl_bench.present.plots, kl_bench.present.report; "
            "assert dict(matplotlib.rcParams) == before and matplotlib.get_backend() == backend, 'rcParams'; "
            "print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "clean", (out.stdout, out.stderr[-2000:])


# ----------------------------------------------------------------------------- layers
# The package tree is the layer table: (package, its one job, the packages it may import directly). A module
# may import its own package and the packages listed, never another (function-local imports included):
# the allowed imports are a graph (results and the analysis do not depend on the engine, for example), and
# that graph has no cycle. Every module of kl_bench belongs to exactly one entry (a top-level module is its
# own entry): a new package must be placed here, or this test fails. README's Architecture section shows the
# same table.
LAYERS = [
    ("foundation", "errors, registries, typed TOML tables, safe file I/O, atomic storage, signals, the one "
     "number formatter, progress", set()),
    ("core", "estimators, targets, clamps and presets, gradient modes, weight corrections, rejection masks, "
     "aggregates, exact oracles, statistics", {"foundation"}),
    ("sampling", "logits sources, samplers (the mismatch options), seeds, alias tables, multinomial count "
     "vectors", {"foundation", "core"}),
    ("kinds", "one module or package per case kind, and the protocols every kind meets",
     {"foundation", "core", "sampling"}),
    ("engine", "seeded batches, feature sums, the gradient pass, torchrun ranks",
     {"foundation", "core", "sampling", "kinds"}),
    ("results", "the stored tables: schemas, the CSV reader and writer, verification, migration, baselines, "
     "checkpoints", {"foundation", "core"}),
    ("experiment", "a spec end to end: parsing, pilot, main pass, summary rows, λ sweep, gradient and group "
     "baseline rows", {"foundation", "core", "sampling", "kinds", "engine", "results"}),
    ("training", "optimisation trajectories", {"foundation", "core", "sampling", "kinds", "engine", "results"}),
    ("audit", "the trainer audit: exact per-position values where the model is, step audits",
     {"foundation", "core", "sampling", "results"}),
    ("analysis", "the regression gate and the advice (what to log, what to put in the loss)",
     {"foundation", "core", "results"}),
    ("present", "terminal tables, figures, the run, training and audit reports",
     {"foundation", "core", "results", "analysis", "training"}),
    ("api", "the Python API, one module per job; runs and trainings written to folders",
     {"foundation", "core", "sampling", "kinds", "engine", "results", "experiment", "training", "audit",
      "analysis", "present"}),
    ("cli", "the command line, a thin layer over the API",
     {"foundation", "core", "kinds", "engine", "results", "training", "audit", "analysis", "present", "api"}),
    ("integrations", "the TRL callback (a thin adapter over the audit)", {"foundation", "core", "kinds", "audit"}),
    ("testing", "the exact check RL libraries run in their own CI: assert_kl_function, goldens, a pytest plugin",
     {"foundation", "core"}),
    ("__main__", "the console entry point", {"foundation", "cli"}),
    ("kl_bench", "the package's lazy public names", {"foundation"}),
]
ALLOWED = {name: deps for name, _, deps in LAYERS}


def _layer_of(module: str) -> str | None:
    """The entry of LAYERS that holds ``module`` (its first name under kl_bench), or None."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return name if name in ALLOWED else None


def test_every_module_has_a_layer_and_imports_only_what_its_layer_may():
    graph = _imports(_modules())
    unplaced = sorted(m for m in graph if _layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add their package to LAYERS): {unplaced}"
    bad = [f"{m} ({_layer_of(m)}) imports {t} ({_layer_of(t)})" for m, targets in sorted(graph.items())
           for t in sorted(targets) if _layer_of(t) != _layer_of(m) and _layer_of(t) not in ALLOWED[_layer_of(m)]]
    assert not bad, "imports the layer table does not allow:\n" + "\n".join(bad)


def test_the_layer_graph_has_no_cycle_and_names_only_layers():
    assert all(deps <= set(ALLOWED) for deps in ALLOWED.values())
    done: set[str] = set()
    while len(done) < len(ALLOWED):          # peel layers whose dependencies are all peeled: a cycle stops it
        ready = {n for n, deps in ALLOWED.items() if n not in done and deps <= done}
        assert ready, f"a cycle among {sorted(set(ALLOWED) - done)}"
        done |= ready


def test_the_package_tree_is_the_layer_table():
    """Every package directory of kl_bench is a layer (or a case kind inside kinds/), and every layer that is
    a package exists."""
    dirs = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert dirs | modules | {"kl_bench"} == set(ALLOWED), sorted((dirs | modules | {"kl_bench"}) ^ set(ALLOWED))


def test_the_layer_table_can_fail():
    assert _layer_of("kl_bench.kinds.rollout.pair") == "kinds" and _layer_of("kl_bench.results.verify") == "results"
    assert _layer_of("kl_bench.nowhere") is None and _layer_of("kl_bench") == "kl_bench"
    assert "engine" not in ALLOWED["results"] and "engine" not in ALLOWED["present"]


def test_old_import_paths_are_gone():
    """0.2.0 removed the forwarding layer of the 0.1.0 paths (CHANGELOG.md): an old path is a plain
    ModuleNotFoundError, and nothing of kl_bench sits on sys.meta_path."""
    code = ("import sys, kl_bench\n"
            "for old in ('kl_bench.estimators', 'kl_bench.pairs.rollout', 'kl_bench.report', 'kl_bench.display'):\n"
            "    try:\n        __import__(old)\n    except ModuleNotFoundError as e:\n        print(e.name)\n"
            "    else:\n        print('still imports:', old)\n"
            "import kl_bench.engine as e\n"
            "print(hasattr(e, 'CaseRun'), [type(f).__module__ for f in sys.meta_path if 'kl_bench' in type(f).__module__])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PKG.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["kl_bench.estimators", "kl_bench.pairs", "kl_bench.report", "kl_bench.display",
                                       "False []"], out.stdout


def test_the_readme_shows_the_layer_table():
    readme = (PKG.parent / "README.md").read_text()
    for name, job, deps in LAYERS:
        if not name.startswith("_") and name != "kl_bench":
            shown = ", ".join(sorted(d for d in deps if not d.startswith("_"))) or "—"
            assert f"| `{name}` | {job} | {shown} |" in readme, name


def test_results_import_no_torch():
    """Every stored folder is described, written and read in kl_bench/results/ (issue 34 item 2) without torch:
    reading, verifying, migrating and gating results needs no tensor library."""
    mods = sorted(m for m in _modules() if m.startswith("kl_bench.results"))
    code = f"import sys, {', '.join(mods)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PKG.parent)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)


def test_reading_reporting_and_gating_results_load_no_engine_kind_or_sampler():
    """`kl-bench report` and `check --results` read folders: they must not load the machinery that wrote
    them (the engine, a case kind, a sampler, the spec parser, the summary-row builder)."""
    code = ("import sys, kl_bench.present.report, kl_bench.analysis.gate, kl_bench.results.verify, kl_bench.analysis.advice; "
            "print('\\n'.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=PKG.parent).stdout.split())
    forbidden = ("kl_bench.engine", "kl_bench.kinds", "kl_bench.sampling", "kl_bench.experiment", "kl_bench.training",
                 "kl_bench.api")
    assert "kl_bench.present.report" in loaded
    assert not [m for m in loaded if m.startswith(forbidden)], [m for m in loaded if m.startswith(forbidden)]
