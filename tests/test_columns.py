"""Every command as a person reads it in an 80-column terminal (issue 44): a real pty with an 80-column window
size and COLUMNS=80, no line wider than 80 cells, no name (a case, an estimator, a file) broken across two
lines, tables paged by whole cases, and the mismatch table only where it says something the case tables did not.

The fast test drives list, exact, run (a sweep's grid too), check, baseline, train and audit in one child
process (one import of torch: the commands run one after another through kl_bench.cli.main); the slow one
drives report and the TRL demo."""
import os
import re
import struct
import sys
import textwrap

import pytest

from .helpers import TRAIN_SPEC

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pty")

COLUMNS = 80
MARK = "=== command: "
LONG = "a-gaussian-case-with-a-long-name"      # names a narrow column would fold mid-word
SAMPLED = "categorical-drawn-at-temperature-0.8"
SPEC = f"""
spec_version = 1
[experiment]
name = "cols"
draws = 20_000
seed = 0
device = "cpu"
batches = 20
estimators = ["k1", "k2", "k3", "fwd_k3"]
[[case]]
name = "{LONG}"
kind = "gaussian"
q = {{ mean = 0.0, std = 1.0 }}
p = {{ mean = 0.3, std = 1.1 }}
[[case]]
name = "{SAMPLED}"
kind = "categorical"
vocab = 100
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 0.3, seed = 2 }}
sampler = {{ temperature = 0.8 }}
[[case]]
name = "categorical-on-policy"
kind = "categorical"
vocab = 100
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 0.5, seed = 2 }}
"""
# A sweep's grid: 9 cases (more than the side-by-side and mismatch tables take), 6 of them drawn from b ≠ q
SWEEP = """
spec_version = 1
[experiment]
name = "grid"
draws = 10_000
seed = 0
device = "cpu"
batches = 10
estimators = ["k1", "k3"]
[[case]]
name = "vocab"
kind = "categorical"
vocab = 50
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
[[sweep]]
case = "vocab"
p.noise = [0.1, 0.3, 1.0]
sampler.temperature = [0.8, 1.0, 1.2]
"""
TRAIN = TRAIN_SPEC.replace('name = "cat"', 'name = "a-categorical-trained-for-three-steps"')


def in_pty(code: str, cwd) -> tuple[int, str]:
    """Run ``python -c code`` in a pseudo-terminal of COLUMNS columns (its window size set, as a terminal
    emulator sets it, and COLUMNS in the environment); its output without escape codes and carriage returns."""
    import fcntl
    import pty
    import termios
    env = {**os.environ, "COLUMNS": str(COLUMNS), "LINES": "50", "TERM": "xterm", "PYTHONWARNINGS": "default"}
    env.pop("NO_COLOR", None)
    pid, fd = pty.fork()
    if pid == 0:                                  # the child: a terminal of 80 columns on stdin, stdout, stderr
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLUMNS, 0, 0))
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-c", code], env)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:                           # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", text)
    # a progress bar redraws its line with \r: what stays on screen is the text after the last one
    lines = [line.rsplit("\r", 1)[-1] for line in text.replace("\r\n", "\n").split("\n")]
    return os.waitstatus_to_exitcode(status), "\n".join(lines)


def driver(commands: list[list[str]]) -> str:
    """A child's code: each command through kl_bench.cli.main in turn, its exit code after it, a marker line
    before it (so the output is split per command)."""
    return textwrap.dedent(f"""
        import sys
        from kl_bench.cli import main
        for argv in {commands!r}:
            print({MARK!r} + " ".join(argv), flush=True)
            try:
                main(argv)
            except SystemExit as e:
                print("=== exit", e.code, flush=True)
    """)


def by_command(text: str) -> dict[str, str]:
    parts = text.split(MARK)[1:]
    return {p.split("\n", 1)[0]: p.split("\n", 1)[1] if "\n" in p else "" for p in parts}


def assert_readable(name: str, out: str, words: list[str]) -> None:
    """No line over COLUMNS cells, and no word of ``words`` broken across a line end (a name folded mid-word:
    its head at the end of one line, its tail at the start of the next)."""
    from rich.cells import cell_len
    wide = [line for line in out.splitlines() if cell_len(line) > COLUMNS]
    assert not wide, f"{name}: {len(wide)} lines over {COLUMNS} columns, e.g. {wide[0]!r}"
    for word in words:
        for k in range(1, len(word)):
            broken = re.search(re.escape(word[:k]) + r"\n\s*" + re.escape(word[k:]), out)
            assert not broken, f"{name}: {word!r} broken across lines: {broken.group(0)!r}"


def _audit_steps(folder) -> None:
    """Three small saved steps (logits form), as tests/test_audit_offline.py makes them."""
    import torch

    import kl_bench
    from kl_bench.audit.saving import save_step
    g = torch.Generator().manual_seed(0)
    folder.mkdir()
    for i in range(3):
        zp, zr = torch.randn(2, 4, 30, generator=g, dtype=torch.float64), torch.randn(2, 4, 30, generator=g,
                                                                                    dtype=torch.float64)
        ids = torch.multinomial(torch.softmax(zp.view(-1, 30), -1), 1, generator=g).view(2, 4)
        lp = torch.log_softmax(zp, -1).gather(-1, ids[..., None]).squeeze(-1).float()
        lr = torch.log_softmax(zr, -1).gather(-1, ids[..., None]).squeeze(-1).float()
        save_step(folder / f"step-{i:04d}.safetensors", policy_logits=zp, reference_logits=zr, completion_ids=ids,
                  mask=torch.ones(2, 4, dtype=torch.uint8), step=i, estimator="trl.grpo", source="loss",
                  trainer_kl=kl_bench.estimate(policy=lp, reference=lr, estimator="trl.grpo"), generation={})


def test_every_command_reads_at_80_columns(tmp_path):
    pytest.importorskip("safetensors")
    (tmp_path / "s.toml").write_text(SPEC)
    (tmp_path / "grid.toml").write_text(SWEEP)
    (tmp_path / "t.toml").write_text(TRAIN)
    _audit_steps(tmp_path / "steps")
    commands = [["--help"], ["run", "--help"], ["list"], ["exact", "s.toml"], ["run", "s.toml", "--out", "o"],
                ["check", "s.toml", "--results", "o"], ["baseline", "s.toml", "--results", "o", "--out", "b.json"],
                ["run", "grid.toml", "--out", "g"], ["train", "t.toml", "--out", "t"], ["audit", "steps"]]
    code, text = in_pty(driver(commands), tmp_path)
    assert code == 0, text
    outs = by_command(text)
    assert len(outs) == len(commands), list(outs)
    assert all(out.rstrip().endswith("=== exit 0") for out in outs.values()), text
    names = [LONG, SAMPLED, "categorical-on-policy", "a-categorical-trained-for-three-steps", "fwd_k3",
             "openrlhf.k3+", "verl.low_var_kl", "summary.csv", "train.csv"]
    names += [f"vocab[p.noise={n};sampler.temperature={t}]" for n in (0.1, 0.3, 1) for t in (0.8, 1, 1.2)]
    for name, out in outs.items():
        assert_readable(name, out, names)
    run = outs["run s.toml --out o"]
    # the mismatch table: the sampled case alone, its name on a line of its own, not the on-policy ones
    mismatch = run[run.index("sampling mismatch"):]
    mismatch = mismatch[:mismatch.index("\n\n")]
    assert SAMPLED in mismatch and LONG not in mismatch and "categorical-on-policy" not in mismatch, mismatch
    # the sweep: a grid of 9 cases gets no side-by-side table, and its 6 cases drawn from b ≠ q (not the 3 at
    # temperature 1, q itself) a mismatch table by whole cases, each name on a line of its own, never paged
    grid = outs["run grid.toml --out g"]
    assert "too many for one table" in grid and "(1/" not in grid, grid
    mismatch = grid[grid.index("sampling mismatch"):]
    mismatch = mismatch[:mismatch.index("\n\n")]
    heads = re.findall(r"^vocab\[.*\]  T=1\.[02]$|^vocab\[.*\]  T=0\.8$", mismatch, flags=re.M)
    assert len(heads) == 6 and "temperature=1]" not in mismatch, mismatch
    # check names each case once, whole, on a line of its own
    check = outs["check s.toml --results o"]
    assert all(re.search(rf"^{re.escape(name)}$", check, flags=re.M) for name in (LONG, SAMPLED)), check
    assert "≥0 up to rounding" in outs["list"]
    assert "README" in outs["--help"]


@pytest.mark.slow
def test_report_and_the_trl_demo_read_at_80_columns(tmp_path):
    """`kl-bench report` (its figures: the progress line) and the documented TRL demo: the audit's lines first and
    whole, TRL's log dicts and progress bar off the terminal, no FutureWarning of the demo's own settings."""
    pytest.importorskip("trl")
    (tmp_path / "s.toml").write_text(SPEC)
    code, text = in_pty(driver([["run", "s.toml", "--out", "o", "-q"], ["report", "o"]]), tmp_path)
    assert code == 0 and text.count("=== exit 0") == 2, text
    assert_readable("report", by_command(text)["report o"], ["report.html", "summary.csv"])
    code, text = in_pty("from kl_bench.integrations.demo import main; main(['--out', 'audit'])", tmp_path)
    assert code == 0, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0].startswith("kl_audit: step 1 kl"), text            # the audit's line first (source kl)
    assert "{'loss'" not in text and "it/s" not in text, text           # no TRL log dict, no progress bar
    assert "gradient_checkpointing` is deprecated" not in text, text
    assert_readable("demo", text, ["trl_log_history.json", "consistency"])


def test_side_by_side_pages_keep_a_cases_two_columns_together():
    """Issue 44: the side-by-side table split a case's bias/true and std/true across pages, the second page
    showing "KL=… std/true" without the case's name. Names of a length that three columns fit 80 but four do
    not: without ``together`` a page held the first case and the second case's bias alone."""
    import io

    import pandas as pd
    from rich.console import Console

    from kl_bench.present.side_tables import side_tables
    from kl_bench.present.terminal import show
    rows = [dict(case=c, estimator=e, aggregate="", target="KL(q||p)", true_kl=0.05, rel_bias=0.012, bias_se=1e-4,
                 exact_rel_bias=0.0121, rel_std=1.523, std_se=1e-3, exact_rel_std=1.521, heavy_tail="", mean=0.0506,
                 se=1e-4, exact_mean=0.0506, sampler="", **{"lambda": float("nan")})
            for c in ("case-number-one-of-three", "case-number-two-of-three", "case-number-three-of-three")
            for e in ("k1", "k3")]
    df = pd.DataFrame(rows)
    table, layout = side_tables(df)[0]
    buf = io.StringIO()
    show(Console(file=buf, width=COLUMNS, force_terminal=True, color_system=None), table, **layout)
    pages = [p for p in buf.getvalue().split("\n\n") if p.strip()]
    assert len(pages) >= 2, buf.getvalue()              # it does not fit on one page: paged
    for page in pages:
        names = sum(f"case-number-{n}" in page for n in ("one", "two", "three"))
        assert names and page.count("KL=") == names, page      # every case on a page with both its columns
