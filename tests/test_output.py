"""Issue 31 items 2 and 3: every number readable as what it is (the SE beside a bias is the one its z uses,
n ±10% only where an exact bias supports it, KL = 0 as a case, degenerate importance weights as unknown,
rounding printed as 0), and every output at 80 columns: each command driven in an 80-column pseudo-terminal
(no line wider, nothing cut), and piped output never wrapped mid-sentence."""
import fcntl
import io
import math
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import torch
from rich.cells import cell_len
from rich.console import Console

import kl_bench
from kl_bench import api
from kl_bench.display import compact_frame, heading, print_tables, prose
from kl_bench.formatting import ROUNDING, count, fmt, plural
from kl_bench.stats import HeavyTail, kish_ess

from .conftest import spec_toml as _spec_text


def spec_toml(experiment: dict, cases: list[dict]) -> dict:
    """A spec as the API takes it (a dict), written as a spec file would be."""
    return tomllib.loads(_spec_text(experiment, cases))

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 80


# ----------------------------------------------------------------------------- inputs
def _log(n=512, t=16, v=20, seed=0):
    """A trainer's log: per-token log-probs of sampled tokens under q and p, a mask, and kl_full."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(n, t, v, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(n, t, v, generator=g, dtype=torch.float64), -1)
    x = torch.multinomial(lq.exp().reshape(-1, v), 1, generator=g).reshape(n, t)
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (n,), generator=g)[:, None]).double()
    return {"logp_policy": lq.gather(-1, x[..., None])[..., 0], "logp_ref": lp.gather(-1, x[..., None])[..., 0],
            "mask": mask, "kl_full": (lq.exp() * (lq - lp)).sum(-1)}


ZIPF = {"logits": "zipf", "exponent": 1.1, "seed": 1}
NOISY = {"from": "q", "noise": 0.3, "seed": 2}


def _cases(log_file: Path) -> list[dict]:
    """A case of every layout the terminal has: exact, a weighted sampler (the mismatch table), p = q
    (KL = 0), a rollout (the rollout table), logged log-probs (a Monte Carlo reference)."""
    return [{"name": "noise0.3", "kind": "categorical", "vocab": 200, "q": ZIPF, "p": NOISY},
            {"name": "stale-weighted", "kind": "categorical", "vocab": 200, "q": ZIPF, "p": NOISY,
             "sampler": {"temperature": 0.8, "weights": "token"}},
            {"name": "step0", "kind": "categorical", "vocab": 200, "q": ZIPF, "p": {"from": "q"}},
            {"name": "roll", "kind": "rollout", "vocab": 20, "buckets": 4, "length": 4, "q": ZIPF, "p": NOISY},
            {"name": "logged", "kind": "logprobs", "file": str(log_file)}]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Specs, results folders and saved training steps for every command."""
    d = tmp_path_factory.mktemp("out80")
    torch.save(_log(64, 8), d / "log.pt")
    est = ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"]
    spec = d / "all.toml"
    spec.write_text(_spec_text({"name": "all", "draws": 20_000, "seed": 0, "device": "cpu", "batches": 20,
                               "estimators": est, "lambdas": [0.5, "optimal"]}, _cases(d / "log.pt")))
    grad = d / "grad.toml"        # the gradient table: the headline of experiments/papers_liu.toml
    grad.write_text(_spec_text({"name": "grad", "draws": 20_000, "seed": 0, "device": "cpu", "batches": 20,
                               "estimators": ["k1", "k2", "k3"], "gradients": True}, _cases(d / "log.pt")[:2]))
    api.run(spec).write(d / "all")
    small = d / "small.toml"
    small.write_text(_spec_text({"name": "small", "draws": 4_000, "seed": 0, "device": "cpu", "batches": 10,
                                "estimators": ["k1", "k3"]}, _cases(d / "log.pt")[:1]))
    for seed in (0, 1):
        api.run(small, seed=seed).write(d / f"small{seed}")
    train = d / "train.toml"
    train.write_text(_spec_text({"name": "trn", "draws": 16, "seed": 0, "device": "cpu"}, _cases(d / "log.pt")[:1])
                     + '[train]\noptimizer = "adam"\nlr = 0.05\nsteps = 3\nbeta = 0.5\ngradients = ["exact"]\n'
                       'combinations = ["k1/reward", "k3/loss"]\n')
    steps = d / "steps"
    steps.mkdir()
    _save_steps(steps)
    return {"dir": d, "spec": spec, "grad": grad, "small": small, "train": train, "steps": steps}


def _save_steps(folder: Path, b=3, t=5, v=97) -> None:
    """Two saved training steps with both models' logits (docs/audit.md)."""
    pytest.importorskip("safetensors")
    from kl_bench.audit.offline import save_step
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        zp = torch.randn(b, t, v, generator=g, dtype=torch.float64)
        zr = zp + 0.5 * torch.randn(b, t, v, generator=g, dtype=torch.float64)
        ids = torch.multinomial(torch.softmax(zp.view(-1, v), -1), 1, generator=g).view(b, t)
        lp = torch.log_softmax(zp, -1).gather(-1, ids[..., None])[..., 0]
        lr = torch.log_softmax(zr, -1).gather(-1, ids[..., None])[..., 0]
        kl = kl_bench.estimate(policy=lp, reference=lr, estimator="k3")
        save_step(folder / f"step-{i:04d}.safetensors", policy_logits=zp, reference_logits=zr, completion_ids=ids,
                  mask=torch.ones(b, t, dtype=torch.uint8), trainer_kl=kl, step=i, estimator="k3", source="loss",
                  generation={})


# ----------------------------------------------------------------------------- an 80-column terminal
# Escape sequences; those that move the cursor or erase a line (a progress bar redrawing) end a line.
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
_MOVES = re.compile(r"\x1b\[[0-9;]*[ABEFGHJKf]|\r")


def _in_terminal(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, list[str]]:
    """Run ``kl-bench ARGS`` in a pseudo-terminal of 80 columns (its stdout and stderr), as a person sees
    it: (exit code, the lines shown, escape sequences removed)."""
    pid, fd = pty.fork()
    if pid == 0:                                           # the child: the terminal's size, then kl-bench
        try:
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, WIDTH, 0, 0))
            os.chdir(cwd)
            env = {**os.environ, "COLUMNS": str(WIDTH), "LINES": "50", "TERM": "xterm-256color"}
            env.pop("NO_COLOR", None)
            os.execve(sys.executable, [sys.executable, "-m", "kl_bench", *args], env)
        finally:
            os._exit(127)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:                                    # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    text = _MOVES.sub("\n", b"".join(chunks).decode("utf-8", "replace"))
    return os.waitstatus_to_exitcode(status), [_ESCAPE.sub("", line) for line in text.split("\n")]


HELPS = ["--help", "run --help", "exact --help", "report --help", "check --help", "baseline --help",
         "train --help", "audit --help", "dump-logits --help", "list --help"]
COMMANDS = {
    "run": (["run", "{spec}", "--out", "{tmp}/r"], ["bias/true ± se", "sampling mismatch", "control variate",
                                                      "to log", "bias ± se", "Monte Carlo reference"]),
    "run gradients": (["run", "{grad}", "--out", "{tmp}/g"], ["E[∇] equals", "n for cos ≥ 0.9"]),
    "exact": (["exact", "{spec}"], ["exact mean", "to log"]),
    "check": (["check", "{spec}", "--results", "{dir}/all"], ["comparisons, family-wise", "check: "]),
    "baseline": (["baseline", "{spec}", "--results", "{dir}/all", "--out", "{tmp}/b.json"], ["baseline of"]),
    "report": (["report", "{dir}/small0", "{dir}/small1", "--out", "{tmp}/rep"], ["report →", "differences:"]),
    "train": (["train", "{train}", "--out", "{tmp}/t"], ["closest to the optimum"]),
    "audit": (["audit", "{steps}", "--out", "{tmp}/a"], ["pooled loss over 2 steps"]),
    "list": (["list"], ["estimator", "kind", "reward", "verl.low_var_kl"]),
    **{h: (h.split(), ["Usage:"]) for h in HELPS},
}


@pytest.mark.skipif(sys.platform == "win32", reason="pty")
@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_fits_an_80_column_terminal(inputs, tmp_path, name):
    """Issue 31 item 3: in an 80-column terminal no line of any command is wider than 80 columns, no cell
    is cut (…), and what the command has to show is there (the gradient table, every comparison)."""
    args, shown = COMMANDS[name]
    fill = {k: str(v) for k, v in inputs.items()} | {"tmp": str(tmp_path)}
    code, lines = _in_terminal([a.format(**fill) for a in args], tmp_path)
    text = "\n".join(lines)
    assert code == 0, text
    wide = [line for line in lines if cell_len(line) > WIDTH]
    assert not wide, f"{len(wide)} lines over {WIDTH} columns, e.g. {wide[0]!r}"
    assert "…" not in text
    for needle in shown:
        assert needle in text, (needle, text)
    if name == "list":        # one entry a line; a long description wraps under its own column, indented
        starts = ("estimator ", "row ", "kind ", "reward ", "plug-in ", " ")
        assert all(line.startswith(starts) for line in lines if line.strip()), text


def test_check_prints_one_line_a_comparison_at_80_columns(inputs, tmp_path):
    """`kl-bench check` printed each comparison on two lines at 80 columns (~750 lines for 372): now one
    line each, under a line per case."""
    code, lines = _in_terminal(["check", str(inputs["spec"]), "--results", str(inputs["dir"] / "all")], tmp_path)
    assert code == 0
    rep = api.check(inputs["dir"] / "all")
    cases = len({c.row.rpartition(": ")[0] for c in rep.comparisons})
    shown = [line for line in lines if line.strip()]
    assert len(shown) <= len(rep.comparisons) + cases + 4, len(shown)      # title, header, verdict
    assert sum(line.rstrip().endswith(" pass") for line in lines) == len(rep.comparisons)


# ----------------------------------------------------------------------------- piped
def test_piped_output_is_never_wrapped_mid_sentence(inputs, tmp_path):
    """Issue 31: the width logic wraps prose at a terminal only: piped, every advice line, warning and
    note is one whole line, however long (grep finds a sentence), and tables keep their natural width."""
    proc = subprocess.run([sys.executable, "-m", "kl_bench", "run", str(inputs["spec"]), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    res = kl_bench.load_results(tmp_path / "r")
    advice = res.recommendations()
    for a in advice:
        if not a.general:
            assert a.text in out, a.text
    general: dict[str, list[str]] = {}
    for a in advice:
        if a.general:
            general.setdefault(a.detail, []).append(a.case)
    assert general
    for detail, cases in general.items():
        assert f"{', '.join(cases)}: {detail}" in out
    assert max(len(line) for line in out) > WIDTH             # not wrapped at the terminal's width either
    from kl_bench.advice import warnings
    for w in warnings(res.summary):
        assert w in proc.stderr.splitlines(), w


def test_prose_wraps_at_a_terminal_and_never_in_a_pipe():
    text = "case: " + " ".join(f"word{i}" for i in range(60))
    pipe, term = io.StringIO(), io.StringIO()
    prose(Console(file=pipe, width=40, force_terminal=False), text)
    prose(Console(file=term, width=40, force_terminal=True, color_system=None), text)
    assert pipe.getvalue() == text + "\n"
    lines = term.getvalue().splitlines()
    assert len(lines) > 5 and all(cell_len(line) <= 40 for line in lines)
    assert all(line.startswith("  ") for line in lines[1:])              # continuation lines indented
    assert " ".join(line.strip() for line in lines) == text              # no word lost or split


# ----------------------------------------------------------------------------- logged data: one SE
def test_logged_data_bias_se_and_z_are_the_logs_own_and_agree(tmp_path):
    """Issue 31 item 2: a logprobs case (512 logged sequences, 100,000 draws) showed the resampling SE of
    the draws beside z computed with the log's own SE. Now the row's bias against Σ kl_full is the log's
    (exact over its sequences), its SE std/√B over them, and z = bias / SE: what is printed agrees."""
    log = _log(512, 16)
    torch.save(log, tmp_path / "log.pt")
    res = kl_bench.run(spec_toml({"name": "lp", "draws": 100_000, "seed": 0, "device": "cpu", "batches": 100,
                                  "estimators": ["k1", "k2", "k3", "full"]},
                                 [{"name": "log", "kind": "logprobs", "file": str(tmp_path / "log.pt")}]))
    df = res.summary.set_index(["estimator", "aggregate"])
    full = (log["mask"] * log["kl_full"]).sum(-1)
    b = full.shape[0]
    logr = (log["mask"] * (log["logp_ref"] - log["logp_policy"])).sum(-1)
    seq = {"k1": -logr, "k2": 0.5 * logr**2, "k3": torch.expm1(logr) - logr}
    shown = compact_frame(res.summary, "log").set_index(["estimator"])
    for name, f in seq.items():                              # the oracle: means over the log, by hand
        d = f - full
        r = df.loc[(name, "seq")]
        assert r["ref_diff"] == pytest.approx(float(d.mean()), rel=1e-12, abs=1e-15)
        assert r["ref_diff_se"] == pytest.approx(float(d.std(correction=1)) / math.sqrt(b), rel=1e-12)
        assert r["z_ref"] == pytest.approx(r["ref_diff"] / r["ref_diff_se"], rel=1e-9)
        ref = float(full.mean())
        cell = shown.loc[f"seq {name}"]
        assert cell["bias/true ± se"] == f"{_pct(r['ref_diff'] / ref)} ± {_pct(r['ref_diff_se'] / ref, False)}"
        assert cell["z"] == fmt(r["z_ref"], 2) and cell["n ±10%"] == "—" and cell["exact"] == ""
        # the resampling SE is far smaller here (100,000 draws of 512 sequences): it must not be the one shown
        assert r["se"] < r["ref_diff_se"] / 3
    assert shown.loc["tok full", "bias/true ± se"] == "reference"
    assert df["n_for_10pct"].isna().all() and df["rmse_b64"].isna().all()     # no truth: nothing planned
    assert "Monte Carlo reference" in heading(res.summary, "log", "logged")


def _pct(x, sign=True):
    from kl_bench.formatting import pct
    return pct(x, sign)


# ----------------------------------------------------------------------------- KL = 0
def test_kl_zero_is_a_case_exact_zeros_no_nan_no_never():
    """p = q (every trainer's step 0): KL = 0 said in the heading, absolute bias and std, exact zeros, n 1,
    and an advice sentence instead of "+nan% biased"."""
    spec = spec_toml({"name": "z", "draws": 10_000, "seed": 0, "device": "cpu", "batches": 10,
                      "estimators": ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"]},
                     [{"name": "step0", "kind": "categorical", "vocab": 300, "q": ZIPF, "p": {"from": "q"}}])
    res = kl_bench.run(spec)
    df = res.summary
    assert (df["true_kl"] == 0).all() and (df["mean"] == 0).all() and (df["se"] == 0).all()
    assert (df["n_for_10pct"] == 1).all()
    frame = compact_frame(df, "step0")
    assert list(frame.columns)[2:5] == ["bias ± se", "exact", "std"]
    assert (frame["bias ± se"] == "0 ± 0").all() and (frame["std"] == "0").all() and (frame["n ±10%"] == "1").all()
    buf = io.StringIO()
    print_tables(Console(file=buf, width=80, force_terminal=True, color_system=None), df, res.descriptions())
    text = buf.getvalue()
    assert "KL(q||p) = 0, KL(p||q) = 0" in text and "KL = 0" in text
    assert "nan" not in text and "never" not in text
    value = [a for a in res.recommendations() if a.use == "value"][0]
    assert "KL(q||p) = 0" in value.text and "nan" not in value.text
    exact = api.exact(spec)
    assert "nan" not in "".join(a.text for a in kl_bench.advice.recommendations(exact))


# ----------------------------------------------------------------------------- degenerate weights
def test_kish_effective_sample_size():
    assert kish_ess(10.0, 10.0) == 10.0                           # ten equal weights of 1
    assert kish_ess(3.0, 5.0) == pytest.approx(1.8)               # weights 1, 2: (1 + 2)² / (1 + 4)
    assert kish_ess(0.0, 0.0) == 0.0                              # every weight underflowed: nothing counts
    assert kish_ess(1.0, math.inf) == 0.0 and math.isnan(kish_ess(math.nan, 1.0))


def test_the_effective_sample_size_agrees_with_its_exact_expectation():
    """The engine's ΣW and ΣW² give Kish's ESS; with token weights w = q/b on a categorical, ESS/N tends to
    (E_b w)²/E_b w² = 1/Σ q²/b, and its SE follows by the delta method from the exact E_b w^k (k ≤ 4)."""
    n = 400_000
    spec = spec_toml({"name": "w", "draws": n, "seed": 3, "device": "cpu", "batches": 50, "estimators": ["k1"]},
                     [{"name": "t", "kind": "categorical", "vocab": 300, "q": ZIPF, "p": NOISY,
                       "sampler": {"temperature": 1.3, "weights": "token"}}])
    res = kl_bench.run(spec)
    ess = float(res.summary["ess"].iloc[0])
    pair = res.pairs[0]
    lq, lb = pair.log_q[0], pair.log_b[0]                    # [V]: one context
    m = [float((lb.exp() * torch.exp(k * (lq - lb))).sum()) for k in range(5)]       # E_b w^k, exact
    assert m[1] == pytest.approx(1.0, rel=1e-12)
    want = 1 / m[2]
    cov = torch.tensor([[m[2] - 1, m[3] - m[2]], [m[3] - m[2], m[4] - m[2] ** 2]], dtype=torch.float64)
    grad = torch.tensor([2 / m[2], -1 / m[2] ** 2], dtype=torch.float64)
    se = math.sqrt(float(grad @ cov @ grad) / n)
    assert abs(ess / n - want) / se < 5, (ess / n, want, se)
    assert want < 0.99                                       # the weights are uneven: the test can fail


DEGENERATE = {"name": "stale-T32", "kind": "rollout", "vocab": 20, "buckets": 4, "length": 32, "q": ZIPF,
              "p": NOISY, "sampler": {"behavior": {"from": "q", "noise": 2.0, "seed": 3}, "weights": "sequence"}}


@pytest.fixture(scope="module")
def degenerate():
    spec = spec_toml({"name": "deg", "draws": 4_000, "seed": 0, "device": "cpu", "batches": 40,
                      "estimators": ["k1", "k3"]}, [DEGENERATE])
    return spec, kl_bench.run(spec)


def test_degenerate_importance_weights_are_unknown_not_a_zero_se(degenerate):
    """A long rollout under a stale sampler with product weights: a handful of draws carry the whole sum,
    and the batch means gave an SE near 0 and z of −10^12 beside "infinite variance". Now such rows say
    "degenerate IS weights", their ESS is shown, and their SE and z are empty, never 0 or 10^12."""
    _, res = degenerate
    df = res.summary
    weighted = df[df["aggregate"].isin(["seq", "tok"])]
    assert (weighted["heavy_tail"] == HeavyTail.DEGENERATE.value).all()
    assert (weighted["ess"] < weighted["batches"]).all() and (weighted["ess"] > 0).all()
    for c in ("se", "z", "std_se", "z_var"):
        assert weighted[c].isna().all(), c
    frame = compact_frame(df, "stale-T32")
    assert (frame.loc[frame["estimator"].str.startswith(("seq", "tok k")), "bias/true ± se"] == "unknown").all()
    buf = io.StringIO()
    print_tables(Console(file=buf, width=80, force_terminal=True, color_system=None), df, res.descriptions())
    text = buf.getvalue()
    assert "effective sample size of" in text and "e+12" not in text and "e+11" not in text


def test_the_gate_neither_passes_nor_fails_degenerate_rows_in_silence(degenerate, tmp_path):
    _, res = degenerate
    rep = api.check(res)
    rows = {c.row for c in rep.comparisons}
    assert not any(r.endswith((": seq k1", ": tok k1", ": seq k3", ": tok k3")) for r in rows)
    note = [n for n in rep.notes if "not compared" in n]
    assert len(note) == 1 and "degenerate importance weights" in note[0] and "effective sample size" in note[0]
    res.write(tmp_path / "r")                               # written, verified and read back: empty SEs allowed
    back = kl_bench.load_results(tmp_path / "r").summary
    assert back["se"].isna().sum() == res.summary["se"].isna().sum()


# ----------------------------------------------------------------------------- words and numbers
def test_numbers_below_the_rounding_floor_print_as_zero():
    assert fmt(6.51e-17, scale=0.149, sign=True) == "0" and fmt(0.00269, scale=0.149, sign=True) == "+0.00269"
    assert fmt(2 * ROUNDING * 0.149, scale=0.149) != "0"      # just above the floor: a number, not rounding
    assert fmt(3.51e-16) == "3.51e-16"                        # without a scale nothing is assumed


def test_one_vocabulary_for_counts():
    assert count(1_439) == "1,439" and count(2_100_000) == "2,100,000" and count(math.inf) == "never"
    assert count(math.nan) == ""
    assert plural(1, "figure") == "1 figure" and plural(2, "figure") == "2 figures"
    assert plural(1, "step") == "1 step" and plural(1_000, "step") == "1,000 steps"


def test_n_for_10pct_is_marked_where_no_exact_bias_is_known():
    from kl_bench.display import n_cell
    base = {"true_kl": 0.1, "exact_mean": 0.1, "n_for_10pct": 1_234.0}
    assert n_cell(base) == "1,234"
    assert n_cell({**base, "n_for_10pct": math.inf}) == "never"
    assert n_cell({**base, "exact_mean": math.nan}) == "—"               # only a measured mean
    assert n_cell({**base, "true_kl": math.nan}) == "—"                  # no truth at all


def test_the_summary_schema_is_self_consistent_after_the_new_columns():
    from kl_bench.results import COLUMNS
    for c in ("ess", "ref_diff", "ref_diff_se"):
        assert c in COLUMNS
    assert pd.Index(COLUMNS).is_unique
