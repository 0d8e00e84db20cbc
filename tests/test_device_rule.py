"""The device rule (docs/devices.md), checked without a GPU: every tensor factory in the package names the
device its tensor belongs on (``device=``), or says on its line why the tensor is the host's
(``# host: why``, on the call or the line above it: a table parsed from a spec, a generator seeded on the CPU by design, a result already
gathered to the host). A factory with neither is where a GPU run meets a CPU tensor; tests on
``device="meta"`` tensors (tests/test_audit_stream.py, the rollout kind's) catch the rest at run time."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kl_bench"
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
             "randperm", "eye", "linspace", "Generator"}
# Front ends that only ever hold host data (files, tables, figures, the command line).
HOST_ONLY = ("cli/", "results/", "report.py", "plots.py", "display.py", "storage.py", "safe_io.py", "figstyle.py",
             "pages.py", "present/")


def _unmarked(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg in ("device", None) for k in node.keywords):     # device=..., or **kw that carries it
            continue
        span = lines[node.lineno - 2:(node.end_lineno or node.lineno)]      # the call and the line above it
        if not any("# host" in line for line in span):
            out.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: torch.{node.func.attr}(...) without device=")
    return out


def test_every_tensor_factory_names_its_device_or_says_it_is_the_hosts():
    files = [p for p in sorted(PACKAGE.rglob("*.py"))
             if not str(p.relative_to(PACKAGE)).startswith(HOST_ONLY)]
    bad = [line for p in files for line in _unmarked(p)]
    assert not bad, "\n".join(bad)


def test_the_lint_finds_an_unmarked_factory(tmp_path):
    bad = tmp_path / "kl_bench" / "x.py"
    bad.parent.mkdir()
    bad.write_text("import torch\na = torch.zeros(3)\nb = torch.zeros(3, device=a.device)\nc = torch.ones(2)  # host: test\n")
    global PACKAGE
    keep, PACKAGE = PACKAGE, bad.parent
    try:
        assert _unmarked(bad) == ["x.py:2: torch.zeros(...) without device="]
    finally:
        PACKAGE = keep


@pytest.mark.parametrize("name", ["docs/devices.md"])
def test_the_rule_is_written_down(name):
    text = (PACKAGE.parent / name).read_text()
    assert "device=" in text and "meta" in text and "# host" in text
