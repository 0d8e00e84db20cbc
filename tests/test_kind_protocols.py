"""One shape for every kind (issue 41, item 1), checked statically: code outside kl_bench/kinds/ reads a pair
through the members of the protocols (kl_bench.kinds.protocols, kl_bench.kinds.trainable) and nothing else, and
every kind's pair class implements the required protocols."""
import ast
import inspect
from pathlib import Path

import pytest

from kl_bench.kinds import CASE_KINDS, protocols, trainable

PKG = Path(__file__).resolve().parents[1] / "kl_bench"
PROTOCOLS = [protocols.CaseParser, protocols.Oracle, protocols.DrawSampler, protocols.CasePair,
             protocols.GradientOracle, protocols.BaselineOracle, protocols.ScoreSampler, trainable.TrainingOracle]


def _members(cls) -> set[str]:
    """The names a protocol declares: its methods, properties and annotated attributes (and its bases')."""
    out: set[str] = set()
    for klass in cls.__mro__:
        if klass in (object, protocols.Protocol) or klass.__module__ == "typing":
            continue
        out |= {n for n in vars(klass) if not n.startswith("_")} | set(getattr(klass, "__annotations__", {}))
    return out


PROTOCOL_MEMBERS = set().union(*map(_members, PROTOCOLS))


def _is_pairs(node: ast.AST) -> bool:
    """An expression that holds pairs: ``pairs``, ``x.pairs``, ``x.pairs[i]``."""
    node = node.value if isinstance(node, ast.Subscript) else node
    return (isinstance(node, ast.Name) and node.id == "pairs") or (isinstance(node, ast.Attribute) and node.attr == "pairs")


def _pair_names(tree: ast.AST) -> set[str]:
    """Names bound to a pair: ``pair``, ``*_pair``, and whatever a loop over pairs or an item of pairs binds."""
    names = {"pair"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and _is_pairs(node.iter) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript) and _is_pairs(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _pair_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Reads of a pair's members (line, member): attributes of a name bound to a pair, of ``x.pair``, of
    ``pairs[i]``, and ``getattr(pair, "name")``."""
    names, out = _pair_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
            holder, member = node.args[0], node.args[1]
            if isinstance(member, ast.Constant) and isinstance(member.value, str) and (
                    (isinstance(holder, ast.Name) and (holder.id in names or holder.id.endswith("_pair")))):
                out.append((node.lineno, member.value))
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name):
            held = v.id in names or v.id.endswith("_pair")
        else:
            held = (isinstance(v, ast.Attribute) and v.attr == "pair") or (isinstance(v, ast.Subscript) and _is_pairs(v))
        if held:
            out.append((node.lineno, node.attr))
    return out


def test_code_outside_kinds_reads_only_protocol_members():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if "kinds" in path.relative_to(PKG).parts:
            continue
        for line, member in _pair_reads(ast.parse(path.read_text(encoding="utf-8"))):
            if member not in PROTOCOL_MEMBERS:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: pair.{member}")
    assert not bad, "members outside the kinds' protocols:\n" + "\n".join(bad)


def test_the_protocol_check_can_fail():
    tree = ast.parse("def f(pair, other_pair, run):\n    for p in run.pairs:\n        p.vocab\n"
                     "    first = run.pairs[0]\n    getattr(pair, 'support_logr')\n"
                     "    return pair.log_q, other_pair.kl(), pair.model, first.sampler, run.pairs[1].kl_forward()\n")
    reads = sorted(m for _, m in _pair_reads(tree))
    assert reads == ["kl", "kl_forward", "log_q", "model", "sampler", "support_logr", "vocab"], reads
    assert {"log_q", "model", "sampler", "support_logr", "vocab"}.isdisjoint(PROTOCOL_MEMBERS)
    assert {"kl", "kl_forward"} <= PROTOCOL_MEMBERS


def _pair_classes() -> list[type]:
    """Every registered kind's pair class and every subclass of one (a kind may build pairs of a subclass: the
    model kind's next-token case)."""
    out, todo = [], [CASE_KINDS[k].pair for k in CASE_KINDS.names()]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.append(cls)
            todo += cls.__subclasses__()
    return sorted(out, key=lambda c: c.__qualname__)


def _missing(cls, protocol) -> list[str]:
    return [f"{protocol.__name__}.{m}" for m in sorted(_members(protocol))
            if not hasattr(cls, m) and m not in getattr(cls, "__annotations__", {}) and m != "name"]


@pytest.mark.parametrize("cls", _pair_classes(), ids=lambda c: c.__qualname__)
def test_every_pair_class_implements_the_required_protocols_and_optional_ones_whole(cls):
    """Whatever is registered (and the subclasses kinds build): the pair class parses and builds (CaseParser),
    answers the oracle and draw protocols (none left abstract), and an optional protocol (gradients,
    baselines, training) is there whole or not at all."""
    assert cls.kind in CASE_KINDS
    missing = [m for p in (protocols.CaseParser, protocols.Oracle, protocols.DrawSampler, protocols.CasePair)
               for m in _missing(cls, p)]
    assert not missing, missing
    assert not inspect.isabstract(cls), getattr(cls, "__abstractmethods__", None)
    for protocol, marker in ((protocols.GradientOracle, "gradient_exact"), (protocols.BaselineOracle, "baseline_exact"),
                             (trainable.TrainingOracle, "training_problem")):
        if hasattr(cls, marker):
            assert not _missing(cls, protocol), _missing(cls, protocol)


def test_the_completeness_check_can_fail():
    class Half:
        kind = "categorical"

        def gradient_exact(self):
            ...
    assert _missing(Half, protocols.GradientOracle) and _missing(Half, protocols.CasePair)


def test_the_registered_kind_decides_whether_a_pair_trains():
    """The model kind's next-token case is a categorical pair but the model kind does not train: refused in one
    line naming the kinds that do (it had trained, inheriting the categorical kind's training). The kinds that
    train are what the registered pair classes declare (trainable.trainable_kinds), not a list written here."""
    import torch

    from kl_bench.foundation.errors import SpecError
    from kl_bench.kinds.categorical import CategoricalPair
    from kl_bench.kinds.model.pair import NextTokenPair
    trains = trainable.trainable_kinds()
    assert trains == [k for k in CASE_KINDS.names() if hasattr(CASE_KINDS[k].pair, "training_problem")]
    assert "categorical" in trains and "model" not in trains
    lq = torch.log_softmax(torch.arange(6, dtype=torch.float64).reshape(2, 3), -1)
    next_token = NextTokenPair("m", lq, lq)
    assert isinstance(next_token, CategoricalPair) and isinstance(next_token, trainable.TrainingOracle)
    assert trainable.training_oracle(next_token) is None
    pair = CategoricalPair("c", lq, lq)
    assert trainable.training_oracle(pair) is pair
    with pytest.raises(SpecError) as e:
        trainable.require_training(next_token, "model", "m")
    assert f"kind 'model' cannot be trained (trainable kinds: {', '.join(trains)})" in str(e.value)


TRAINING_SPEC = PKG.parent / "experiments" / "training.toml"


def test_every_trainable_kind_gives_a_training_problem():
    """experiments/training.toml trains a case of every kind that declares training (and no other kind): each
    case's pair, through the path `kl-bench train` takes (plan_case), gives a TrainingProblem whose exact values,
    gradient and expected update at θ0 are finite and shaped as θ0."""
    import math

    import torch

    from kl_bench.experiment.spec import load_spec
    from kl_bench.kinds import build_pair
    from kl_bench.training.config import parse_train
    from kl_bench.training.run import plan_case
    spec = load_spec(TRAINING_SPEC)
    cfg = parse_train(spec.train, str(TRAINING_SPEC), TRAINING_SPEC.parent)
    first = {}
    for case in spec.cases:
        first.setdefault(case.kind, case)
    assert sorted(first) == sorted(trainable.trainable_kinds()), \
        f"{TRAINING_SPEC.name} should train one case of each trainable kind"
    for kind, case in first.items():
        plan = plan_case(case, build_pair(case), cfg, seed=0)
        problem = plan.problem
        assert isinstance(problem, trainable.TrainingProblem), kind
        values, grad = problem.evaluate(problem.theta0)
        assert grad.shape == problem.theta0.shape and bool(torch.isfinite(grad).all()), kind
        assert values and all(math.isfinite(v) for v in values.values()), (kind, values)
        update = problem.expected_update(problem.theta0, plan.combos[0])
        assert update.shape == problem.theta0.shape and bool(torch.isfinite(update).all()), kind
