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


def _pair_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Attribute reads on a name that holds a pair: ``pair``, ``*_pair`` or ``self.pair`` (line, member)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else ""
        if name == "pair" or name.endswith("_pair"):
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
    tree = ast.parse("def f(pair, other_pair):\n    return pair.log_q, other_pair.kl(), pair.model\n")
    reads = [m for _, m in _pair_reads(tree)]
    assert reads == ["log_q", "kl", "model"] or sorted(reads) == ["kl", "log_q", "model"]
    assert "log_q" not in PROTOCOL_MEMBERS and "model" not in PROTOCOL_MEMBERS and "kl" in PROTOCOL_MEMBERS


@pytest.mark.parametrize("kind", CASE_KINDS.names())
def test_every_kind_implements_the_required_protocols(kind):
    """Whatever is registered: the pair class parses and builds (CaseParser), and an instance would answer the
    oracle and draw protocols (their methods are all defined, none left abstract)."""
    cls = CASE_KINDS[kind].pair
    assert cls.kind == kind
    missing = [f"{p.__name__}.{m}" for p in (protocols.CaseParser, protocols.Oracle, protocols.DrawSampler,
                                            protocols.CasePair)
               for m in _members(p) if not hasattr(cls, m) and m not in getattr(cls, "__annotations__", {})
               and m not in ("name",)]
    assert not missing, missing
    assert not inspect.isabstract(cls), getattr(cls, "__abstractmethods__", None)
    if hasattr(cls, "training_problem"):                  # an optional protocol is all there or not at all
        assert hasattr(cls, "train_aggregates")
