"""docs/architecture.md's "Where to add X" table is a map that is true (issue 41 item 5): every file, folder and
module a row names exists, every name it gives in code quotes is defined in a file or module of the same row
(a def, a class, an assignment or an annotated field; or a module of kl_bench, or a builtin), and every row is
checked by a test file that exists."""
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ROWS = ("an estimator", "a library preset", "a gradient mode", "a case kind", "a summary column",
        "an output format of the report", "a trainer library in the audit", "a check for a library's KL code")


def _table(text: str) -> dict[str, tuple[str, str]]:
    """The section's rows: what to add → (touch, checked by)."""
    section = text[text.index("## Where to add X"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] != "to add":
            out[cells[0]] = (cells[1], cells[2])
    return out


def _module_file(dotted: str) -> tuple[Path | None, str]:
    """``kl_bench.a.b[.name]`` → (the file of its longest importable prefix, what is left of it)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path, ".".join(parts[n:])
    return None, dotted


def _defined(name: str, texts: list[str]) -> bool:
    """``name`` is a def, a class, an assignment or an annotated field in one of ``texts``, a module of
    kl_bench (``report_md``), or a builtin (``KeyError``)."""
    pattern = rf"(?m)\b(def|class)\s+{name}\b|^\s*{name}\s*(:|=[^=])|\b{name}\s*=\s*[^=]"
    return (any(re.search(pattern, t) for t in texts) or hasattr(builtins, name)
            or any((ROOT / "kl_bench").rglob(f"{name}.py")))


def problems(touch: str, checked: str) -> list[str]:
    """What a row names that does not exist: paths, kl_bench modules, names in code quotes (each defined in a
    file of the row: :func:`_defined`), and a checked-by cell without an existing test file."""
    quoted = re.findall(r"`([^`]+)`", touch + " " + checked)
    bad, files = [], []
    for q in quoted:
        if "/" in q and " " not in q and "<" not in q:          # a path (report_<format>.py is a pattern)
            path = ROOT / q.rstrip("/")
            if not path.exists():
                bad.append(f"no such path: {q}")
            elif path.is_file():
                files.append(path)
        elif re.fullmatch(r"kl_bench(\.\w+)+", q):
            path, rest = _module_file(q)
            if path is None:
                bad.append(f"no such module: {q}")
            else:
                files.append(path)
                if rest and not re.search(rf"\b{re.escape(rest)}\b", path.read_text(encoding="utf-8")):
                    bad.append(f"{q}: {rest} not in {path.relative_to(ROOT)}")
    texts = [f.read_text(encoding="utf-8") for f in files]
    for q in quoted:
        name = q.split("(")[0] if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*\(\.\.\.\)", q) else q
        if re.fullmatch(r"[A-Za-z_]\w*", name) and not _defined(name, texts):
            bad.append(f"`{q}` is defined in none of the row's files")
    if not any((ROOT / t).is_file() for t in re.findall(r"`(tests/test_\w+\.py)`", checked)):
        bad.append("checked by no existing test file")
    return bad


def test_the_table_has_every_row():
    table = _table(DOC.read_text(encoding="utf-8"))
    assert [r for r in ROWS if not any(k.startswith(r) for k in table)] == [], sorted(table)
    assert len(table) == len(ROWS)


@pytest.mark.parametrize("row", ROWS)
def test_every_file_module_name_and_test_a_row_gives_exists(row):
    table = _table(DOC.read_text(encoding="utf-8"))
    touch, checked = next(v for k, v in table.items() if k.startswith(row))
    assert problems(touch, checked) == []


def test_the_map_check_can_fail():
    touch = "`kl_bench/core/nowhere.py`; `kl_bench.core.estimators.no_such_name`; `NO_SUCH_TABLE` in `kl_bench/core/modes.py`"
    assert problems(touch, "`tests/test_nowhere.py`") == [
        "no such path: kl_bench/core/nowhere.py",
        "kl_bench.core.estimators.no_such_name: no_such_name not in kl_bench/core/estimators.py",
        "no such path: tests/test_nowhere.py", "`NO_SUCH_TABLE` is defined in none of the row's files",
        "checked by no existing test file"]
    # used there but defined elsewhere: PLACEMENTS is imported by checks.py, defined in cases.py
    assert problems("`PLACEMENTS` in `kl_bench/testing/checks.py`", "`tests/test_testing.py`") == [
        "`PLACEMENTS` is defined in none of the row's files"]
    assert problems("`MODES` in `kl_bench/core/modes.py`", "`tests/test_gradients.py`") == []
