"""`kl-bench --help` as a new user reads it (issue 44): the commands in the order of a workflow (run, look,
gate, train, audit, tools), and every page and section the commands' help points at exists."""
import re
from pathlib import Path

import typer

from kl_bench.cli import app

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ["run", "exact", "report", "check", "baseline", "train", "audit", "dump-logits", "list"]


def test_help_lists_the_commands_in_the_order_of_a_workflow():
    assert list(typer.main.get_command(app).commands) == WORKFLOW


def test_every_page_and_section_the_help_points_at_exists():
    """A reference in the commands' docstrings and option help: 'docs/x.md' (the file), optionally with
    ', "Section"' (a heading of that page)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "kl_bench" / "cli").glob("*.py"))
    refs = re.findall(r'(docs/[\w.-]+\.md|README)(?:, "([^"]+)")?', text)
    assert refs
    for page, section in refs:
        path = ROOT / ("README.md" if page == "README" else page)
        assert path.is_file(), page
        if section:
            assert re.search(rf"^#+ {re.escape(section)}\s*$", path.read_text(encoding="utf-8"), flags=re.M), (page, section)
