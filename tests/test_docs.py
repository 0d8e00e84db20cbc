"""The README and docs/ as a new user meets them (issue 25 item 10): every relative link resolves (file
and anchor), every `kl-bench` command and flag they show exists, and the README stays a first-hour
document."""
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kl_bench.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors: headings lower-cased, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
            out.add(text.replace(" ", "-"))
    return out


def _links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)      # not inside code blocks
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        # a link's target is a path and/or an anchor (maths such as [z^x](A_1^D ...) is not a link)
        if not target.startswith(("http://", "https://", "mailto:")) and re.fullmatch(r"[\w./#%-]+", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, "\n".join(bad)


def _shown_commands():
    """(page, (command, the rest of its line)) for `kl-bench ...` in code blocks and inline code."""
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                yield from ((page, cmd) for cmd in
                            re.findall(r"(?:^|&& |\| |\$ )kl-bench ([a-z-]+)((?: [^&|#]*)?)", line.strip()))
        for inline in re.findall(r"`kl-bench ([a-z-]+)([^`]*)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            yield page, inline


def test_every_shown_command_and_flag_exists():
    runner = CliRunner()
    helps: dict[str, str] = {}
    bad = []
    shown = list(_shown_commands())
    assert len({c for _, (c, _) in shown}) >= 8          # the docs show the commands: nothing vacuous
    for page, (command, rest) in shown:
        if command not in helps:
            res = runner.invoke(app, [command, "--help"])
            helps[command] = res.output if res.exit_code == 0 else ""
        if not helps[command]:
            bad.append(f"{page.name}: kl-bench {command}: no such command")
            continue
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
            if flag not in helps[command]:
                bad.append(f"{page.name}: kl-bench {command} {flag}: no such option")
    assert not bad, "\n".join(bad)


def test_the_readme_is_a_first_hour_document():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) < 2500
    for needed in ("## Install and run (one command)", "## Tests (one command)", "## Reading the output",
                   "## Python API", "## Where to go next"):
        assert needed in text


def _reading_the_output() -> tuple[list[str], str]:
    """The code blocks of the README's "Reading the output" section, and its prose outside them."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Reading the output"):text.index("## Tests (one command)")]
    return re.findall(r"```\n(.*?)```", section, flags=re.S), re.sub(r"```.*?```", "", section, flags=re.S)


def test_the_readmes_example_is_what_an_80_column_terminal_shows_of_the_committed_run():
    """Issue 31: the README's table and advice blocks are kl-bench's own output for results/vocab50k in an
    80-column terminal (tables and the advice's wrapping), and the prose under them quotes their numbers."""
    import io

    from rich.console import Console

    import kl_bench
    from kl_bench.present.tables import print_tables
    from kl_bench.present.terminal import prose
    table_block, advice_block = _reading_the_output()[0]
    res = kl_bench.load_results(ROOT / "results" / "vocab50k")
    first = res.summary["case"].iloc[0]
    buf = io.StringIO()
    con = Console(file=buf, width=80, force_terminal=True, color_system=None, highlight=False)
    print_tables(con, res.summary[res.summary["case"] == first], res.descriptions())
    assert buf.getvalue().strip() == table_block.strip()
    buf = io.StringIO()
    con = Console(file=buf, width=80, force_terminal=True, color_system=None, highlight=False)
    advice = res.recommendations()
    prose(con, advice[0].text)
    general = [a for a in advice if a.general]
    prose(con, f"{', '.join(a.case for a in general)}: {general[0].detail}")
    assert buf.getvalue().strip() == advice_block.strip()


def test_the_prose_under_the_readmes_example_quotes_its_numbers():
    blocks, prose_text = _reading_the_output()
    bullets = prose_text[prose_text.index("- **bias/true"):prose_text.index("Then the advice")]
    numbers = set(re.findall(r"[+-]?\d[\d,]*(?:\.\d+)?%?", bullets)) - {"10%", "95%", "5", "0"}
    assert len(numbers) >= 8                                        # the prose does quote the table
    missing = [n for n in numbers if n.lstrip("+") not in blocks[0]]
    assert not missing, f"README prose quotes numbers its block does not show: {missing}"


def test_the_trl_versions_claimed_are_the_ones_ci_runs():
    """Issue 43 item 5: the docs' claim, the trl extra's pin, the adapter's tested range and CI agree: CI runs the
    live TRL tests on the newest TRL claimed (the extra installs it) and on the oldest (.ci/run's own venv)."""
    import tomllib
    from kl_bench.integrations.trl_contract import TESTED, TESTED_TEXT
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    newest = f"{hi_major}.{hi_minor - 1}"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    assert f"trl>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}" in extra
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'TRL_OLDEST="trl=={lo_major}.{lo_minor}.0"' in ci and "tests/test_audit_trl.py" in ci
    assert f"run live: {lo_major}.{lo_minor}.0, {newest}.0" in TESTED_TEXT
    claim = f"TRL {lo_major}.{lo_minor} to {newest}"
    for page in ("README.md", "docs/audit.md"):
        assert claim in (ROOT / page).read_text(), page
