"""The boundaries of the rollout kind (issue 34, item 1), checked statically: the kind is in parts that
nothing outside reads; the aggregate registry (maths) names no kind; training asks a pair the training
protocol (kl_bench.kinds.trainable) and imports no kind's internals; the kind dispatches on no aggregate's,
token form's, weights option's or mode's name."""
import ast
from pathlib import Path

from kl_bench.core.aggregates import AGGREGATES
from kl_bench.core.modes import MODES
from kl_bench.kinds.rollout.gradients import TOKEN_FORMS
from kl_bench.kinds.rollout.model import WEIGHTINGS

from .test_architecture import _imports, _modules

PKG = Path(__file__).resolve().parents[1] / "kl_bench"
ROLLOUT = "kl_bench.kinds.rollout"


def _tree(module: str) -> ast.AST:
    return ast.parse(_modules()[module].read_text(encoding="utf-8"))


def _outside(module: str) -> bool:
    return module != ROLLOUT and not module.startswith(ROLLOUT + ".")


def test_no_module_outside_the_rollout_package_reads_its_internals():
    """Outside the package nobody imports more than the package's own names (training included: it asks the
    training protocol), and nobody reads a rollout pair's oracle or its model."""
    graph, bad = _imports(_modules()), []
    for mod, targets in sorted(graph.items()):
        if not _outside(mod):
            continue
        bad += [f"{mod} imports {t}" for t in sorted(targets) if t.startswith(ROLLOUT + ".")]
        for node in ast.walk(_tree(mod)):
            if isinstance(node, ast.Attribute) and node.attr == "oracle":
                bad.append(f"{mod}:{node.lineno}: reads {ast.unparse(node)}")
            if (isinstance(node, ast.Attribute) and node.attr == "model" and isinstance(node.value, ast.Name)
                    and node.value.id.endswith("pair")):
                bad.append(f"{mod}:{node.lineno}: reads {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_the_aggregate_registry_names_no_kind():
    """The built-in aggregates carry no kind's hooks, and no module of the maths layer reads a pair (the
    rollout kind owns its aggregates' oracles: kl_bench.kinds.rollout.aggregates)."""
    import kl_bench.core.aggregates as A
    builtins = ("", "seq", "tok", "tok_mean", "tok_batch", "tok_gm")
    assert all(AGGREGATES[a].exact is None and AGGREGATES[a].enabled is None for a in builtins)
    maths = sorted(m for m in _modules() if m.startswith("kl_bench.core."))
    assert "kl_bench.core.aggregates" in maths and "kl_bench.core.draws" in maths
    bad = []
    for mod in maths:
        for node in ast.walk(_tree(mod)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pair":
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "kinds" in ast.unparse(node):
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
    assert A.__name__ == "kl_bench.core.aggregates"


def test_training_imports_no_kind_and_names_none():
    """kl_bench.training asks a case's pair the training protocol (kl_bench.kinds.trainable) and nothing else of
    the kinds: it imports no kind module, keeps no table keyed by a kind's name, and names no kind's class."""
    kinds = {"kl_bench.kinds", "kl_bench.kinds.trainable"}
    bad = []
    for mod, targets in sorted(_imports(_modules()).items()):
        if mod.startswith("kl_bench.training"):
            bad += [f"{mod} imports {t}" for t in sorted(targets) if t.startswith("kl_bench.kinds") and t not in kinds]
            text = _modules()[mod].read_text(encoding="utf-8")
            bad += [f"{mod} names {w}" for w in ("RolloutPair", "CategoricalPair", "RolloutModel", '"categorical"',
                                                  '"rollout"') if w in text]
    assert not bad, "\n".join(bad)


def _compared_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants that a comparison (==, !=, in, not in) tests a value against."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            for side in [node.left, *node.comparators]:
                for c in ast.walk(side):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        out.append((node.lineno, c.value))
    return out


def test_the_rollout_kind_dispatches_on_no_name():
    """Aggregates, token forms, weights options and gradient modes are tables the kind looks up, never
    string if-chains on their names (in the kind's package and in the dynamic program)."""
    names = (set(AGGREGATES) - {""}) | set(TOKEN_FORMS) | set(WEIGHTINGS) | set(MODES)
    bad = []
    for mod in [m for m in _modules() if not _outside(m)] + ["kl_bench.core.rollout_dp"]:
        bad += [f"{mod}:{line}: compares with '{s}'" for line, s in _compared_strings(_tree(mod)) if s in names]
    assert not bad, "\n".join(bad)


def test_the_name_check_can_fail():
    src = "if weights == 'token':\n    pass\nx = 1 if item.token in ('local', 'score') else 2\n"
    assert [s for _, s in _compared_strings(ast.parse(src))] == ["token", "local", "score"]


# ----------------------------------------------------------------------------- Pair and the protocols
def _protocol_members(*protocols) -> set[str]:
    out = set()
    for p in protocols:
        out |= {name for klass in p.__mro__ if klass.__name__ not in ("Protocol", "Generic", "object")
                for name in list(vars(klass)) + list(getattr(klass, "__annotations__", {})) if not name.startswith("_")}
    return out


def test_pair_holds_only_what_every_kind_must_have():
    """Pair's public members are CasePair's (and the spec parser's); the optional members (gradients,
    baselines) live with their protocols and their defaults, never in Pair."""
    from kl_bench.kinds.protocols import CasePair, GradientOracle
    from kl_bench.kinds.defaults import GradientDefaults, Pair
    pair = {name for name in vars(Pair) if not name.startswith("_")} | set(Pair.__annotations__)
    assert pair <= _protocol_members(CasePair) | {"parse", "from_config"}, sorted(pair - _protocol_members(CasePair))
    gradient_only = _protocol_members(GradientOracle)
    assert not pair & gradient_only, sorted(pair & gradient_only)
    defaults = {name for name in vars(GradientDefaults) if not name.startswith("_")}
    assert defaults <= gradient_only, sorted(defaults - gradient_only)


def test_the_engine_experiment_and_results_ask_a_pair_only_its_protocols():
    """Every ``pair.X`` (or ``run.pair.X``) read in the engine, the experiment, the gradient and baseline rows
    and the results is a member of a protocol of kl_bench.kinds.protocols (they are typed against them)."""
    from kl_bench.kinds.protocols import BaselineOracle, CasePair, GradientOracle
    allowed = _protocol_members(CasePair, GradientOracle, BaselineOracle)
    mods = ["kl_bench.engine.monte_carlo", "kl_bench.experiment.case", "kl_bench.experiment.gradient_rows",
            "kl_bench.experiment.lambdas", "kl_bench.experiment.group_baselines", "kl_bench.experiment.rows",
            "kl_bench.experiment.gates",
            "kl_bench.core.planning", "kl_bench.engine.distributed"] + [m for m in _modules() if m.startswith("kl_bench.results")]
    bad = []
    for mod in mods:
        for node in ast.walk(_tree(mod)):
            if isinstance(node, ast.Attribute):
                owner = ast.unparse(node.value)
                if (owner == "pair" or owner.endswith(".pair")) and node.attr not in allowed:
                    bad.append(f"{mod}:{node.lineno}: {owner}.{node.attr}")
    assert not bad, "\n".join(bad)
