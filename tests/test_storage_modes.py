"""A results folder written over an existing one keeps what its owner set and what kl-bench did not write:
the folder's mode (private 0700, a shared setgid 02770, sticky) and group, the permissions of a file it
replaces (a summary.csv made private), and the user's own files in a subfolder it writes (a report's
figures/). The folder is swapped in whole (kl_bench.foundation.storage.write_folder), so each of these is
copied from the old folder, not left in place."""
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.foundation import atomic, attributes, storage
from kl_bench.foundation.errors import SpecError

runner = CliRunner()
UMASK = os.umask(0)
os.umask(UMASK)

FILES = {"summary.csv": b"new,1\n", "run.json": b"{}\n", "figures/a.png": b"new png", "figures/deep/b.png": b"b"}


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _other_group() -> int | None:
    """A group the process may give its files other than its own: any as root, else a supplementary one."""
    if os.geteuid() == 0:
        return os.getegid() + 4242
    return next((g for g in os.getgroups() if g != os.getegid()), None)


@pytest.fixture
def old(tmp_path):
    """A folder as an earlier write left it, with the user's notes beside it."""
    out = tmp_path / "out"
    storage.write_locked(out, {**FILES, "summary.csv": b"old,1\n", "figures/a.png": b"old png"})
    (out / "notes.txt").write_text("mine")
    return out


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o2770, 0o1777, 0o3775])
def test_a_rewritten_folder_keeps_its_mode(old, mode):
    """`chmod 700 priv` became 755 after a run into it; `chmod 2770` lost setgid and the group's access."""
    old.chmod(mode)
    storage.write_locked(old, FILES)
    assert _mode(old) == mode and (old / "summary.csv").read_bytes() == b"new,1\n"
    assert (old / "notes.txt").read_text() == "mine"


def test_a_rewritten_folder_keeps_its_group_and_new_files_take_a_setgid_group(old):
    group = _other_group()
    if group is None:
        pytest.skip("the process belongs to no other group")
    os.chown(old, -1, group)
    old.chmod(0o2770)
    (old / "summary.csv").unlink()              # a file this write makes new: the folder's group, by setgid
    storage.write_locked(old, FILES)
    assert old.stat().st_gid == group and _mode(old) == 0o2770
    assert (old / "summary.csv").stat().st_gid == group


def test_a_group_the_process_may_not_set_is_skipped_silently_and_the_mode_kept(old, monkeypatch):
    """os.chown of the group fails (EPERM) for a user not in that group: the results are written all the
    same, with the group they were made with, and the mode bits kept."""
    os.chown(old, -1, _other_group() or os.getegid())
    old.chmod(0o750)

    def refused(*a, **kw):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(attributes.os, "chown", refused)
    storage.write_locked(old, FILES)
    assert _mode(old) == 0o750 and (old / "summary.csv").read_bytes() == b"new,1\n"


@pytest.mark.parametrize("exchange", [True, False], ids=["swap", "file-by-file"])
def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_default(old, monkeypatch, exchange):
    """A results file made private (chmod 600) or read-only (444) keeps that when the folder is rewritten;
    set-id bits are not carried to new contents; a file the folder did not have gets 0666 less the umask.
    Both ways a folder is written: swapped in whole, and file by file where the swap is unavailable."""
    if not exchange:
        monkeypatch.setattr(storage, "_exchange", lambda a, b: False)
    (old / "summary.csv").chmod(0o600)
    (old / "run.json").chmod(0o444)
    (old / "figures" / "a.png").chmod(0o4750)
    (old / "figures" / "deep" / "b.png").unlink()
    (old / "figures").chmod(0o750)
    storage.write_locked(old, FILES)
    assert (old / "summary.csv").read_bytes() == b"new,1\n" and (old / "figures" / "a.png").read_bytes() == b"new png"
    assert [_mode(old / n) for n in ("summary.csv", "run.json", "figures/a.png", "figures", "figures/deep/b.png")] \
        == [0o600, 0o444, 0o750, 0o750, 0o666 & ~UMASK]


def test_a_single_file_replaced_keeps_its_permissions(tmp_path):
    target = tmp_path / "table.csv"
    target.write_text("old\n")
    target.chmod(0o640)
    atomic.atomic_write_bytes(target, b"new\n")
    assert target.read_bytes() == b"new\n" and _mode(target) == 0o640


def test_the_users_files_in_a_subfolder_it_writes_are_kept(old):
    """`report --out R` deleted R/figures/mine.png: only the top-level entries were carried over, so a
    subfolder kl-bench writes was replaced whole. Now every entry it does not write is kept, at any depth."""
    (old / "figures" / "mine.png").write_text("keep")
    (old / "figures" / "deep" / "mine.txt").write_text("keep too")
    (old / "figures" / "sub").mkdir()
    (old / "figures" / "sub" / "x").write_text("x")
    (old / "figures" / "link").symlink_to("mine.png")
    storage.write_locked(old, FILES)
    assert (old / "figures" / "a.png").read_bytes() == b"new png"
    assert (old / "figures" / "mine.png").read_text() == "keep"
    assert (old / "figures" / "deep" / "mine.txt").read_text() == "keep too"
    assert (old / "figures" / "sub" / "x").read_text() == "x" and os.readlink(old / "figures" / "link") == "mine.png"
    assert (old / "notes.txt").read_text() == "mine"
    assert not list(old.parent.glob(".out.*"))


@pytest.mark.parametrize("plant", ["folder", "symlink"])
def test_an_entry_that_is_not_a_file_at_an_output_name_in_a_subfolder_is_refused(old, plant):
    """As at the top level (safe_io.check_folder_entries): a folder or a link where kl-bench writes a file in
    a subfolder is refused in one line, and nothing changes."""
    target = old / "figures" / "deep" / "b.png"
    target.unlink()
    if plant == "folder":
        target.mkdir()
        (target / "precious").write_text("precious")
    else:
        target.symlink_to(old / "notes.txt")
    before = sorted(str(p) for p in old.rglob("*"))
    with pytest.raises(SpecError, match="refusing to replace it") as e:
        storage.write_locked(old, FILES)
    assert "b.png" in str(e.value) and sorted(str(p) for p in old.rglob("*")) == before
    assert (old / "summary.csv").read_bytes() == b"old,1\n"


def test_a_report_and_a_run_into_existing_folders_keep_modes_and_the_users_figures(tmp_path, build_spec, write_spec):
    """The probe's commands: `run --out priv` (chmod 700) and `report --out R` with R/figures/mine.png."""
    spec = write_spec(build_spec([{"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
                                   "p": {"mean": 0.1, "std": 1.0}}], draws=4000, batches=8))
    priv = tmp_path / "priv"
    priv.mkdir()
    priv.chmod(0o700)
    assert runner.invoke(app, ["run", str(spec), "-q", "--out", str(priv)]).exit_code == 0
    assert _mode(priv) == 0o700
    rep = tmp_path / "R"
    (rep / "figures").mkdir(parents=True)
    (rep / "figures" / "mine.png").write_text("keep")
    (rep / "notes.txt").write_text("keep")
    rep.chmod(0o2750)
    res = runner.invoke(app, ["report", str(priv), "-q", "--out", str(rep)])
    assert res.exit_code == 0, res.output
    assert (rep / "figures" / "mine.png").read_text() == "keep" and (rep / "notes.txt").read_text() == "keep"
    assert (rep / "report.md").exists() and _mode(rep) == 0o2750


def test_a_carried_file_the_kernel_will_not_link_is_copied(old, monkeypatch):
    """Carrying the user's files over hard-links them; where the kernel refuses (another user's file in a
    shared group folder under fs.protected_hardlinks: EPERM) they are copied, contents and mode, and the
    write goes through (it had failed with 'Operation not permitted'). Other link errors still fail it."""
    import errno
    real = os.link
    refused: list[str] = []

    def link(src, dst, *a, **k):
        if Path(src).name in ("notes.txt", "mine.png"):
            refused.append(Path(src).name)
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real(src, dst, *a, **k)
    (old / "figures" / "mine.png").write_text("mine")
    (old / "notes.txt").chmod(0o640)
    monkeypatch.setattr(os, "link", link)
    storage.write_locked(old, FILES)
    assert sorted(refused) == ["mine.png", "notes.txt"]
    assert (old / "notes.txt").read_text() == "mine" and (old / "figures" / "mine.png").read_text() == "mine"
    assert _mode(old / "notes.txt") == 0o640 and (old / "summary.csv").read_bytes() == FILES["summary.csv"]

    def broken(src, dst, *a, **k):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(os, "link", broken)
    with pytest.raises(SpecError, match="I/O error"):               # one line, the old folder untouched
        storage.write_locked(old, FILES)
    assert (old / "notes.txt").read_text() == "mine"
