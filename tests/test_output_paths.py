"""Where outputs go: --out names that cannot be a results or report folder, links, FIFOs and devices
at an output or lock path (never followed, never replaced, also as an unprivileged user), an output over
the command's own input or over the current folder, and what stands inside --out: one line, exit 2,
nothing written, earlier results kept."""
import contextlib
import os
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

import kl_bench.api as api
from kl_bench.cli import app
from kl_bench.foundation import atomic
from kl_bench.foundation.errors import SpecError

from .helpers import (TRAIN_SPEC, cli_inprocess, gauss_spec, gauss_text, leftovers, one_line,
                      one_line_proc, runner, tree)


@pytest.mark.parametrize("out,needle", [("file", "exists and is not a folder"), ("under-file", "is a file"),
                                        ("/dev/null", "exists and is not a folder"), ("/proc/kl-bench-x", "cannot"),
                                        ("", "must name a results folder"), (".", "must name a results folder"),
                                        ("..", "must name a results folder")])
def test_bad_out_folders_are_one_line_and_write_nothing(small_spec, tmp_path, out, needle):
    (tmp_path / "afile").write_text("keep")
    target = {"file": str(tmp_path / "afile"), "under-file": str(tmp_path / "afile" / "r")}.get(out, out)
    before = sorted(os.listdir(tmp_path))
    res = runner.invoke(app, ["run", str(small_spec), "--out", target, "-q"])
    one_line(res, 2, needle, "--out")
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "afile").read_text() == "keep"


def test_exact_out_at_a_folder_or_under_a_file(small_spec, tmp_path):
    (tmp_path / "afile").write_text("keep")
    one_line(runner.invoke(app, ["exact", str(small_spec), "--out", str(tmp_path)]), 2, "is a folder")
    one_line(runner.invoke(app, ["exact", str(small_spec), "--out", str(tmp_path / "afile" / "x.csv")]), 2, "is a file")


def test_symlinked_out_is_refused_and_nothing_is_left_behind(small_spec, tmp_path):
    """kl-bench never writes through a link (the results used to land where it pointed): one line naming
    the link, the link and its folder untouched."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    res = runner.invoke(app, ["run", str(small_spec), "--out", str(link), "-q"])
    one_line(res, 2, "--out", "symbolic link")
    assert link.is_symlink() and list(real.iterdir()) == [] and leftovers(tmp_path) == []


def test_resume_with_nothing_to_resume_writes_nothing(small_spec, tmp_path):
    out = tmp_path / "deep" / "res"
    res = runner.invoke(app, ["run", str(small_spec), "--out", str(out), "--resume"])
    one_line(res, 2, "nothing to resume")
    assert not (tmp_path / "deep").exists()


# ============================================================================ 2. never through a link, onto a device
def test_a_symlink_at_the_lock_path_is_refused_and_its_target_kept(tmp_path):
    spec = gauss_spec(tmp_path, "l")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / ".out.lock").symlink_to(victim)
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "out"), "-q"])
    one_line(res, 2, "symbolic link")
    assert victim.read_text() == "precious"


def test_a_fifo_at_the_lock_path_is_refused(tmp_path, no_hang):
    spec = gauss_spec(tmp_path, "l")
    os.mkfifo(tmp_path / ".out.lock")
    one_line(runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "out"), "-q"]), 2, "FIFO")


@pytest.mark.parametrize("command", ["exact", "baseline"])
def test_out_dev_null_stays_a_device(tmp_path, command):
    spec = gauss_spec(tmp_path, "d")
    res = runner.invoke(app, [command, str(spec), "--out", "/dev/null", *(["-q"] if command == "baseline" else [])])
    one_line(res, 2, "/dev/null", "character device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("command", ["exact", "baseline"])
def test_out_at_a_symlink_is_refused_and_its_target_kept(tmp_path, command):
    spec = gauss_spec(tmp_path, "d")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link.csv").symlink_to(victim)
    res = runner.invoke(app, [command, str(spec), "--out", str(tmp_path / "link.csv"),
                                 *(["-q"] if command == "baseline" else [])])
    one_line(res, 2, "symbolic link")
    assert victim.read_text() == "precious" and (tmp_path / "link.csv").is_symlink()


def test_atomic_writes_refuse_a_link_or_device_that_appears_at_the_target(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "next_token.pt"
    link.symlink_to(victim)
    with pytest.raises(SpecError, match="symbolic link"):
        atomic.atomic_write_bytes(link, b"x")
    from kl_bench.kinds.model.dump import _save        # dump-logits' writer: the folder swapped in whole
    with pytest.raises(SpecError, match="symbolic link"):
        _save(link, {"next_token.pt": b"x"})
    out = tmp_path / "dump"
    out.mkdir()
    (out / "next_token.pt").symlink_to(victim)
    with pytest.raises(SpecError, match="symbolic link where kl-bench writes a file; refusing to replace it"):
        _save(out, {"next_token.pt": b"x"})             # a link inside the folder: neither followed nor replaced
    assert (out / "next_token.pt").is_symlink()
    assert victim.read_text() == "precious" and not list(tmp_path.glob(".tmp-*"))
    assert not list(tmp_path.glob(".*staging*")) and not list(tmp_path.glob(".*.lock"))


def test_result_write_onto_a_file_or_device_is_the_packages_error(tmp_path):
    res = api.run(str(gauss_spec(tmp_path, "w")))
    (tmp_path / "afile").write_text("keep")
    for target in (tmp_path / "afile", Path("/dev/null")):
        with pytest.raises(SpecError, match="not a folder"):
            res.write(target)
    assert (tmp_path / "afile").read_text() == "keep" and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def _as_nobody():
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def _cli_as_nobody(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run the CLI in a forked child that has dropped to nobody (uid/gid 65534). Forking keeps the
    interpreter loaded, and the child first runs the same command as root onto a scratch file so that
    every module it imports lazily is loaded: nothing under /root needs to be readable by nobody."""
    import tempfile
    import traceback
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:                    # the child: never returns into pytest
        code = 70
        try:
            os.chdir(cwd)
            from kl_bench.cli import main
            warm = [a if a != argv[-1] else str(cwd / "warm-up.csv") for a in argv]
            with contextlib.suppress(SystemExit):
                with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    main(warm)
            _as_nobody()
            os.dup2(err.fileno(), 2)
            os.dup2(err.fileno(), 1)
            sys.stdout = sys.stderr = open(err.fileno(), "w", closefd=False)   # pytest has replaced both
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            sys.stderr.flush()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    with err:
        err.seek(0)
        return os.waitstatus_to_exitcode(status), err.read().decode("utf-8", "replace")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch to nobody")
def test_as_an_unprivileged_user_dev_null_and_links_are_refused_too(tmp_path):
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="kl-bench-nobody-"))
    os.chmod(work, 0o777)
    spec = gauss_spec(work, "u")
    os.chmod(spec, 0o644)
    (work / "link.csv").symlink_to(work / "victim")
    assert os.getuid() == 0
    code, err = _cli_as_nobody(["exact", str(spec), "--out", "/dev/null"], work)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "/dev/null" in err, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    code, err = _cli_as_nobody(["exact", str(spec), "--out", str(work / "link.csv")], work)
    assert code == 2 and "symbolic link" in err and not (work / "victim").exists(), err
    # and nobody really was nobody: a root-only folder is out of reach
    private = Path(tempfile.mkdtemp(prefix="kl-bench-root-"))
    os.chmod(private, 0o700)
    for cmd in (["exact", str(spec), "--out"], ["run", str(spec), "-q", "--out"]):
        code, err = _cli_as_nobody(cmd + [str(private / "x")], work)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Permission denied" in err, err
        assert not (private / "x").exists()


# ============================================================================ 4. one line, exit 2, everywhere
@pytest.mark.parametrize("where, needle", [("file", "is a file; --out names the report folder"), ("under-file", "is a file"),
                                           ("/dev/null", "not a folder"), ("/proc/kl-bench-x", "cannot"),
                                           ("long", "255 bytes")])
def test_report_out_that_cannot_be_a_folder(gauss_results, tmp_path, where, needle):
    (tmp_path / "afile").write_text("keep")
    target = {"file": tmp_path / "afile", "under-file": tmp_path / "afile" / "r",
              "long": tmp_path / ("x" * 300)}.get(where, where)
    one_line(runner.invoke(app, ["report", str(gauss_results["res"]), "--out", str(target)]), 2, needle)
    assert (tmp_path / "afile").read_text() == "keep"


@pytest.mark.parametrize("command", ["run", "exact"])
def test_an_out_name_over_255_bytes_is_one_line(gauss_results, tmp_path, command):
    res = runner.invoke(app, [command, str(gauss_results["spec"]), "--out", str(tmp_path / ("é" * 200))])
    one_line(res, 2, "255 bytes", "--out")


# ----------------------------------------------------------------------------- report --out, baseline's default
@pytest.mark.parametrize("out, needle", [("new.html", "looks like a file name; --out names the report folder"),
                                         ("notes.md", "give e.g. --out"),
                                         ("file", "is a file; --out names the report folder")])
def test_report_out_is_a_folder_and_a_file_name_says_so(gauss_results, tmp_path, out, needle):
    (tmp_path / "file").write_text("keep")
    before = tree(tmp_path)
    res = runner.invoke(app, ["report", str(gauss_results["res"]), "--out", str(tmp_path / out)])
    assert res.exit_code == 2 and needle in res.output and "key '--out'" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and tree(tmp_path) == before


def test_a_report_folder_whose_name_has_a_suffix_is_still_a_folder(gauss_results, tmp_path):
    (tmp_path / "r.html").mkdir()           # asked for: an existing folder is a folder whatever its name
    assert runner.invoke(app, ["report", str(gauss_results["res"]), "--out", str(tmp_path / "r.html")]).exit_code == 0
    assert (tmp_path / "r.html" / "report.html").is_file()


def test_baseline_never_writes_into_the_tracked_tree_unless_asked(gauss_results, tmp_path, monkeypatch):
    """`kl-bench baseline experiments/ci.toml` replaced the committed results/baselines/ci.json."""
    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "results" / "baselines" / "made.json"
    committed.parent.mkdir(parents=True)
    committed.write_text("committed")
    res = runner.invoke(app, ["baseline", str(gauss_results["spec"]), "--results", str(gauss_results["res"])])
    assert res.exit_code == 0, res.output
    assert committed.read_text() == "committed"
    assert "→ runs/baselines/made.json" in res.output and "--out results/baselines/made.json" in res.output
    made_now = tmp_path / "runs" / "baselines" / "made.json"
    # the gate reads the committed one by default, the new one when asked
    assert runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_results["res"]), "--baseline",
                               str(made_now), "-q"]).exit_code == 0
    res = runner.invoke(app, ["baseline", str(gauss_results["spec"]), "--results", str(gauss_results["res"]), "--out", str(committed)])
    assert res.exit_code == 0 and '"kl_bench_baseline": 1' in committed.read_text(), res.output


# ----------------------------------------------------------------------------- what stands inside --out
@pytest.mark.parametrize("plant", ["folder", "fifo", "symlink"])
def test_an_entry_at_an_output_name_that_is_not_a_regular_file_is_refused_and_kept(gauss_results, tmp_path, plant,
                                                                                  no_hang):
    """A folder, a FIFO or a symlink at summary.csv inside an existing results folder was swapped out with
    the old folder (a user's folder at batches.csv, and what it held, deleted in silence). Now one line,
    exit 2, and the folder as it was."""
    out = tmp_path / "out"
    shutil.copytree(gauss_results["res"], out)
    (out / "summary.csv").unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    {"folder": lambda p: (p.mkdir(), (p / "precious.txt").write_text("precious")),
     "fifo": lambda p: os.mkfifo(p), "symlink": lambda p: p.symlink_to(victim)}[plant](out / "summary.csv")
    before = tree(out) if plant != "fifo" else None
    proc = cli_inprocess("run", gauss_results["spec"], "--out", out, "-q")
    one_line_proc(proc, 2, "summary.csv", "refusing to replace it", "key '--out'")
    if before is not None:
        assert tree(out) == before
    assert victim.read_text() == "precious" and not list(tmp_path.glob(".out.*"))


def test_a_symlink_as_the_results_folder_is_refused(gauss_results, tmp_path):
    """kl-bench never writes through a link: --out naming a symlink to a folder is one line, exit 2, and
    the folder it points to is untouched."""
    target = tmp_path / "target"
    shutil.copytree(gauss_results["res"], target)
    before = tree(target)
    (tmp_path / "link").symlink_to(target)
    for command in (["run", gauss_results["spec"], "--out", tmp_path / "link", "-q"],
                    ["report", gauss_results["res"], "--out", tmp_path / "link"]):
        one_line_proc(cli_inprocess(*command), 2, "symbolic link", "key '--out'")
    assert tree(target) == before


def test_a_symlink_at_the_checkpoint_is_refused_before_any_sampling(gauss_results, tmp_path):
    """--resume (or checkpoints) with a symlink at .checkpoint.npz: refused at start, its target neither read
    nor written (it was read through the link, and refused only at the first checkpoint's write)."""
    ck = tmp_path / "ck"
    shutil.copytree(gauss_results["ck"], ck)
    real = tmp_path / "elsewhere.npz"
    (ck / ".checkpoint.npz").rename(real)
    (ck / ".checkpoint.npz").symlink_to(real)
    before = real.read_bytes()
    one_line_proc(cli_inprocess("run", gauss_results["spec"], "--out", ck, "--resume", "-q"), 2, "symbolic link", "key '--resume'")
    one_line_proc(cli_inprocess("run", gauss_results["spec"], "--out", ck, "-q"), 2, "symbolic link", ".checkpoint.npz", "key '--out'")
    assert real.read_bytes() == before and not (ck / "summary.csv").exists()


@pytest.mark.parametrize("args, key, needle", [
    (["exact", "{spec}", "--out", "{spec}", "-q"], "--out", "is the spec this command reads"),
    (["exact", "{spec}", "--out", "-", "-q"], "--out", "'-' is not read as stdout"),
    (["check", "{spec}", "--results", "{res}", "--json", "{spec}"], "--json", "is the spec this command reads"),
    (["check", "{link}", "--results", "{res}", "--junit", "{spec}"], "--junit", "is the spec this command reads"),
    (["check", "{spec}", "--results", "{res}", "--json", "{res}/summary.csv"], "--json",
     "is a file of the results folder"),
    (["check", "{spec}", "--results", "{res}", "--junit", "{res}/run.json"], "--junit",
     "is a file of the results folder"),
    (["check", "{spec}", "--results", "{res}", "--baseline", "{base}", "--json", "{base}"], "--json",
     "is the baseline this command reads"),
    (["exact", "{spec}", "--out", "{base}", "-q"], "--out", "is a kl-bench baseline"),
    (["exact", "{spec}", "--out", "{res}/batches.csv", "-q"], "--out", "is a file of the results folder"),
    (["check", "{spec}", "--results", "{res}", "--json", "{out}/v.out", "--junit", "{out}/./v.out"], "--junit",
     "names the --json file too"),
    (["baseline", "{spec}", "--results", "{res}", "--out", "{spec}"], "--out", "is the spec this command reads"),
    (["baseline", "{spec}", "--results", "{res}", "--out", "{res}/run.json"], "--out", "is a file of the results folder"),
    (["report", "{res}", "--out", "{res}/", "-q"], "--out", "is a results folder this report reads"),
])
def test_an_output_over_the_commands_own_input_is_refused(gauss_results, tmp_path, args, key, needle):
    """An output path naming one of the command's inputs (the spec, through a link too; the --results folder
    or a file in it; the --baseline; the other report of the same command) is one line, exit 2, and every
    input keeps its bytes: `exact --out SPEC` had replaced the spec with a CSV, `check --json
    DIR/summary.csv` a results file (whose recorded sha256 then failed every later read)."""
    (tmp_path / "link.toml").symlink_to(gauss_results["spec"])
    fill = dict(spec=gauss_results["spec"], res=gauss_results["res"], base=gauss_results["base"], link=tmp_path / "link.toml", out=tmp_path)
    before = (gauss_results["spec"].read_bytes(), tree(gauss_results["res"]), gauss_results["base"].read_bytes())
    proc = cli_inprocess(*[a.format(**fill) for a in args], cwd=tmp_path)
    one_line_proc(proc, 2, f"key '{key}'", needle)
    assert (gauss_results["spec"].read_bytes(), tree(gauss_results["res"]), gauss_results["base"].read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.toml"]


def test_a_rerun_says_the_report_it_kept_is_stale(gauss_results, tmp_path):
    """A rerun keeps the files it did not write (a report among them): one line on stderr, even with -q,
    says the report describes the replaced results; `--report` remakes it and says nothing."""
    out = tmp_path / "r"
    shutil.copytree(gauss_results["res"], out)
    (out / "report").mkdir()
    (out / "report" / "report.md").write_text("seed 0")
    proc = cli_inprocess("run", gauss_results["spec"], "--out", out, "-q", "--seed", "5")
    assert proc.returncode == 0 and "describes the results this run replaced" in proc.stderr, proc.stderr
    assert (out / "report" / "report.md").read_text() == "seed 0"          # kept, not deleted
    proc = cli_inprocess("run", gauss_results["spec"], "--out", out, "-q", "--seed", "6", "--report")
    assert proc.returncode == 0 and "describes" not in proc.stderr, proc.stderr


def test_the_default_baseline_is_an_input_too_and_a_report_beside_the_results_is_fine(gauss_results, tmp_path):
    """`check --json results/baselines/<name>.json` (the baseline the gate reads when --baseline is not given)
    had replaced it with the check's JSON; a report written into the results folder under a name of its
    own (DIR/check.json, a CI's habit) is allowed: the folder still reads."""
    (tmp_path / "results" / "baselines").mkdir(parents=True)
    default = tmp_path / "results" / "baselines" / "made.json"
    shutil.copy(gauss_results["base"], default)
    proc = cli_inprocess("check", gauss_results["spec"], "--results", gauss_results["res"], "--json", default, cwd=tmp_path)
    one_line_proc(proc, 2, "key '--json'", "is the baseline this command reads")
    assert default.read_bytes() == gauss_results["base"].read_bytes()
    res = tmp_path / "res"
    shutil.copytree(gauss_results["res"], res)
    assert cli_inprocess("check", gauss_results["spec"], "--results", res, "--json", res / "check.json", cwd=tmp_path).returncode == 0
    assert (res / "check.json").exists() and cli_inprocess("check", gauss_results["spec"], "--results", res, cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("args, key", [(["exact", "{spec}", "--out", "{data}", "-q"], "--out"),
                                       (["check", "{spec}", "--json", "{data}", "-q"], "--json"),
                                       (["check", "{spec}", "--junit", "./{data_name}", "-q"], "--junit"),
                                       (["baseline", "{spec}", "--out", "{data}", "-q"], "--out")])
def test_an_output_over_a_file_the_spec_reads_is_refused(tmp_path, args, key):
    """A spec's own data (logits in q.npy) is an input too: `exact --out q.npy` and `check --json q.npy` had
    replaced it with a CSV or JSON, and the spec then failed to load. Refused before any sampling."""
    data = tmp_path / "q.npy"
    np.save(data, np.linspace(-1.0, 1.0, 50))
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "s"\ndraws = 1000\ndevice = "cpu"\n[[case]]\n'
                    'name = "c"\nkind = "categorical"\nq = { file = "q.npy" }\np = { from = "q", noise = 0.2, seed = 1 }\n')
    before = data.read_bytes()
    proc = cli_inprocess(*[a.format(spec=spec, data=data, data_name=data.name) for a in args], cwd=tmp_path)
    one_line_proc(proc, 2, f"key '{key}'", "is a file the spec reads")
    assert data.read_bytes() == before


def test_a_folder_of_another_kind_is_not_replaced_and_a_report_is_judged_before_sampling(gauss_results, tmp_path):
    """`train --out` or `audit --out` over a run's results folder had replaced it (its summary.csv gone, in
    silence): one line, exit 2, the folder unchanged; a run's own folder is still replaced by a run. And
    `run --report` into a folder whose report/ is read-only is refused before any sampling, not after."""
    res = tmp_path / "res"
    shutil.copytree(gauss_results["res"], res)
    before = tree(res)
    train = tmp_path / "t.toml"
    train.write_text(TRAIN_SPEC)
    proc = cli_inprocess("train", train, "--out", res, "-q")
    one_line_proc(proc, 2, "holds kl-bench run results", "key '--out'")
    assert tree(res) == before
    (res / "report").mkdir()
    (res / "report").chmod(0o555)
    try:
        proc = cli_inprocess("run", gauss_results["spec"], "--out", res, "-q", "--report")
        one_line_proc(proc, 2, "read-only folder", "key '--report'")
        assert tree(res) == {**before, "report": None}
    finally:
        (res / "report").chmod(0o755)
    assert cli_inprocess("run", gauss_results["spec"], "--out", res, "-q", "--seed", "4").returncode == 0


@pytest.mark.parametrize("command", ["run", "train", "report"])
@pytest.mark.parametrize("where", ["here", "above"])
def test_the_current_folder_or_one_holding_it_is_refused_as_out(tmp_path, monkeypatch, command, where):
    """`--out "$PWD"` swapped the folder the shell stood in for a new one: the shell was left in a deleted
    folder (its next kl-bench died loading torch's libraries). Refused like '.', before any work, for every
    command that writes a folder; the folder and what is in it stay as they were."""
    here = tmp_path / "w"
    here.mkdir()
    (here / "s.toml").write_text(TRAIN_SPEC if command == "train" else gauss_text(name="s"))
    if command == "report":
        assert runner.invoke(app, ["run", str(here / "s.toml"), "--out", str(here / "r"), "-q"]).exit_code == 0
    before = os.stat(here).st_ino, sorted(os.listdir(here))
    monkeypatch.chdir(here)
    out = here if where == "here" else tmp_path
    args = {"run": ["run", "s.toml", "-q"], "train": ["train", "s.toml"], "report": ["report", "r", "-q"]}[command]
    res = runner.invoke(app, [*args, "--out", str(out)])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "is the current folder, or holds it" in lines[0], res.output
    assert (os.stat(here).st_ino, sorted(os.listdir(here))) == before
