"""`kl-bench audit DIR` on saved steps (safetensors): logits and hidden-state forms agree, the results folder
is written, and bad input is one line naming file and key with exit code 2."""
import json
import math
import os

import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.audit import Sampler, audit_step, position_values, sampler_logprobs
from kl_bench.audit.offline import audit_folder
from kl_bench.audit.saving import save_step
from kl_bench.cli import app

pytest.importorskip("safetensors")
runner = CliRunner()
B, T, V, D = 3, 5, 97, 8


def _step(g, gen: dict):
    hp, hr = 0.5 * torch.randn(B, T, D, generator=g), 0.5 * torch.randn(B, T, D, generator=g)
    wp, wr = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    zp, zr = hp.double() @ wp.double().T, hr.double() @ wr.double().T
    sp = Sampler.from_dict(gen)
    ids = torch.multinomial(torch.exp(sampler_logprobs(zp.view(-1, V), sp)), 1, generator=g).view(B, T)
    mask = torch.arange(T) < torch.tensor([[5], [3], [4]])
    lp = torch.log_softmax(zp, -1).gather(-1, ids[..., None]).squeeze(-1).float()
    lr = torch.log_softmax(zr, -1).gather(-1, ids[..., None]).squeeze(-1).float()
    kl = kl_bench.estimate(policy=lp, reference=lr, estimator="trl.grpo")
    return dict(hp=hp, hr=hr, wp=wp, wr=wr, zp=zp, zr=zr, ids=ids, mask=mask, kl=kl)


def _save(folder, s, i, gen, form):
    common = dict(completion_ids=s["ids"], mask=s["mask"].to(torch.uint8), trainer_kl=s["kl"], step=i,
                  estimator="trl.grpo", source="loss", generation=gen)
    if form == "logits":
        save_step(folder / f"step-{i:04d}.safetensors", policy_logits=s["zp"], reference_logits=s["zr"], **common)
    else:
        save_step(folder / f"step-{i:04d}.safetensors", policy_hidden=s["hp"], reference_hidden=s["hr"], **common)


@pytest.fixture
def folders(tmp_path):
    g = torch.Generator().manual_seed(0)
    gen = {"top_k": 10}
    steps = [_step(g, gen) for _ in range(3)]
    out = {}
    for form in ("logits", "hidden"):
        d = tmp_path / form
        d.mkdir()
        out[form] = d
    for i, s in enumerate(steps):
        _save(out["logits"], s, i, gen, "logits")
        if i == 0:     # step 0 takes its output layers from the folder's heads.safetensors
            _save(out["hidden"], s, i, gen, "hidden")
        else:          # the others carry their own
            _save_with_heads(out["hidden"], s, i, gen)
    from safetensors.torch import save_file
    save_file({"policy_weight": steps[0]["wp"], "reference_weight": steps[0]["wr"]},
              str(out["hidden"] / "heads.safetensors"))
    return out, steps


def _save_with_heads(folder, s, i, gen):
    save_step(folder / f"step-{i:04d}.safetensors", completion_ids=s["ids"], mask=s["mask"], trainer_kl=s["kl"],
              step=i, estimator="trl.grpo", source="loss", generation=gen, policy_hidden=s["hp"],
              reference_hidden=s["hr"], policy_weight=s["wp"], reference_weight=s["wr"])


def test_cli_audit_writes_the_results_folder_and_forms_agree(folders):
    dirs, steps = folders
    res = runner.invoke(app, ["audit", str(dirs["logits"])])
    assert res.exit_code == 0, res.output
    assert res.output.count("step ") >= 3 and "pooled loss over 3 steps" in res.output
    csv = (dirs["logits"] / "audit" / "audit.csv").read_text().splitlines()
    assert len(csv) == 4
    env = json.loads((dirs["logits"] / "audit" / "run.json").read_text())
    assert env["pooled"]["loss"]["steps"] == 3
    # `kl-bench report` on the audit folder: the figures and the pooled line per source
    rep = runner.invoke(app, ["report", str(dirs["logits"] / "audit"), "--formats", "png,pdf"])
    assert rep.exit_code == 0, rep.output
    report = dirs["logits"] / "audit" / "report"
    import pandas as pd
    from kl_bench.present.audit_report import pooled_line
    df = pd.read_csv(dirs["logits"] / "audit" / "audit.csv")
    assert pooled_line(df[df["source"] == "loss"]) in (report / "report.md").read_text()
    z = df["bias"].sum() / (df["se"] ** 2).sum() ** 0.5
    from kl_bench.foundation.formatting import fmt
    assert f"pooled z = {fmt(z, 2, sign=True)}" in (report / "report.md").read_text()
    assert (report / "figures" / "audit_loss.png").stat().st_size > 10_000
    assert (report / "figures" / "audit_loss.pdf").read_bytes().startswith(b"%PDF")
    a = audit_folder(dirs["logits"]).rows
    h = audit_folder(dirs["hidden"], tile=16).rows
    for x, y, s in zip(a, h, steps):
        m = s["mask"]
        direct = audit_step(position_values(s["zp"][m], s["zr"][m], ("trl.grpo",), Sampler(top_k=10), ids=s["ids"][m]),
                            s["kl"], m, estimator="trl.grpo", source="loss")
        for f in ("logged", "exact", "expected_b", "se", "z", "consistency_z", "miss"):
            assert getattr(x, f) == pytest.approx(getattr(direct, f), rel=1e-12, abs=1e-14), f
            assert getattr(y, f) == pytest.approx(getattr(direct, f), rel=1e-10, abs=1e-12), f


def _bad_step(d, **change):
    """A small valid step at step-0009 with ``change`` applied to its tensors or settings."""
    kw = dict(completion_ids=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3), trainer_kl=torch.zeros(2, 3),
              step=9, estimator="k3", policy_logits=torch.zeros(2, 3, 5), reference_logits=torch.zeros(2, 3, 5))
    save_step(d / "step-0009.safetensors", **{**kw, **change})


@pytest.mark.parametrize("edit, match", [
    (lambda d: save_step(d / "step-0009.safetensors", completion_ids=torch.zeros(2, 3, dtype=torch.long),
                         mask=torch.ones(2, 3), trainer_kl=torch.zeros(2, 3), step=9, estimator="trl.grpo"),
     "step-0009.safetensors: key 'policy_logits': needs policy_logits and reference_logits"),
    (lambda d: save_step(d / "step-0009.safetensors", completion_ids=torch.zeros(2, 3, dtype=torch.long),
                         mask=torch.ones(2, 4), trainer_kl=torch.zeros(2, 3), step=9, estimator="trl.grpo",
                         policy_logits=torch.zeros(2, 3, 5), reference_logits=torch.zeros(2, 3, 5)),
     "key 'mask': must have completion_ids' shape"),
    (lambda d: save_step(d / "step-0009.safetensors", completion_ids=torch.zeros(2, 3, dtype=torch.long),
                         mask=torch.ones(2, 3), trainer_kl=torch.zeros(2, 3), step=9, estimator="k33",
                         policy_logits=torch.zeros(2, 3, 5), reference_logits=torch.zeros(2, 3, 5)),
     "key 'estimator': unknown estimator 'k33'"),
    (lambda d: save_step(d / "step-0009.safetensors", completion_ids=torch.zeros(2, 3, dtype=torch.long),
                         mask=torch.ones(2, 3), trainer_kl=torch.zeros(2, 3), step=9, estimator="k3",
                         generation={"top_kk": 5}, policy_logits=torch.zeros(2, 3, 5),
                         reference_logits=torch.zeros(2, 3, 5)),
     "key 'generation.top_kk': unknown generation setting"),
    (lambda d: save_step(d / "step-0009.safetensors", completion_ids=torch.zeros(2, 3, dtype=torch.long),
                         mask=torch.ones(2, 3), trainer_kl=torch.zeros(2, 3), step=9, estimator="k3",
                         logit_softcap=-1.0, policy_logits=torch.zeros(2, 3, 5), reference_logits=torch.zeros(2, 3, 5)),
     "key 'logit_softcap': must be a finite number > 0, got '-1.0'"),
    (lambda d: (d / "step-0009.safetensors").write_bytes(b"not a safetensors file"), "step-0009.safetensors: cannot read"),
    # Values the audit cannot compute from: an id outside the vocabulary at a masked-in position (a
    # traceback from the gather), float ids, a mask of 2, NaN logits, a scale that is not a number.
    (lambda d: _bad_step(d, completion_ids=torch.full((2, 3), 5)), "key 'completion_ids': holds ids outside the vocabulary [0, 5)"),
    (lambda d: _bad_step(d, completion_ids=torch.full((2, 3), 1.0)), "key 'completion_ids': must hold integer token ids"),
    (lambda d: _bad_step(d, mask=torch.full((2, 3), 2.0)), "key 'mask': must hold 0 or 1"),
    (lambda d: _bad_step(d, policy_logits=torch.full((2, 3, 5), math.nan)), "key 'policy_logits': holds NaN or infinite"),
    (lambda d: _bad_step(d, logit_scale=math.nan), "key 'logit_scale': must be a finite number > 0"),
    # What an accident or an attacker can put at a step's path: one line, never a blocked open (a FIFO
    # held `kl-bench audit` in open() until SIGKILL) nor an endless read.
    (lambda d: os.mkfifo(d / "step-0009.safetensors"), "step-0009.safetensors: is a FIFO (named pipe), not a regular"),
    (lambda d: (d / "step-0009.safetensors").symlink_to("/dev/zero"), "is a character device, not a regular"),
    (lambda d: (d / "step-0009.safetensors").mkdir(), "step-0009.safetensors: is a folder, not a regular"),
    (lambda d: os.mkfifo(d / "heads.safetensors"), "heads.safetensors: is a FIFO (named pipe), not a regular"),
    (lambda d: (d / "heads.safetensors").symlink_to(d / "nowhere"), "heads.safetensors: heads file not found (a dangling symbolic link)"),
])
def test_bad_saved_steps_are_one_line_errors_and_nothing_is_written(folders, edit, match):
    dirs, _ = folders
    edit(dirs["logits"])
    res = runner.invoke(app, ["audit", str(dirs["logits"])])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in res.output
    assert not (dirs["logits"] / "audit").exists()


@pytest.mark.parametrize("args,key", [(["--tile", "0"], "--tile"), (["--chunk", "-3"], "--chunk"),
                                      (["--tile", "0", "--chunk", "0"], "--tile")])
def test_pieces_below_one_are_one_line(tmp_path, args, key):
    res = runner.invoke(app, ["audit", str(tmp_path), *args])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and key in lines[0] and "≥ 1" in lines[0], res.output


@pytest.mark.parametrize("args", [["--tile", "16"], ["--chunk", "1e3"], ["--out", "elsewhere"]])
def test_options_a_folder_without_steps_would_ignore_are_refused(folders, tmp_path, args):
    """A results folder without saved steps is read back (its audit.csv's verdicts; nothing audited or
    written): --tile, --chunk and --out were accepted and ignored. One line naming the option, exit 2."""
    dirs, _ = folders
    assert runner.invoke(app, ["audit", str(dirs["logits"])]).exit_code == 0
    folder = dirs["logits"] / "audit"
    assert runner.invoke(app, ["audit", str(folder)]).exit_code == 0          # read back
    if args[0] == "--out":
        args = ["--out", str(tmp_path / args[1])]
    res = runner.invoke(app, ["audit", str(folder), *args])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert f"key '{args[0]}': has no effect here" in lines[0] and "holds no saved steps" in lines[0], lines[0]
    assert not (tmp_path / "elsewhere").exists()


def test_an_empty_folder_is_one_line(tmp_path):
    res = runner.invoke(app, ["audit", str(tmp_path)])
    assert res.exit_code == 2 and "no step-*.safetensors files" in res.output


def test_soft_capped_hidden_states_audit_as_their_capped_logits(tmp_path):
    # Saved logits are the model's (already capped); hidden states need logit_softcap to be capped alike.
    g = torch.Generator().manual_seed(3)
    s, cap = _step(g, {}), 2.0
    capped = {k: cap * torch.tanh(s[k] / cap) for k in ("zp", "zr")}
    common = dict(completion_ids=s["ids"], mask=s["mask"], trainer_kl=s["kl"], step=0, estimator="trl.grpo")
    for form in ("l", "h"):
        (tmp_path / form).mkdir()
    save_step(tmp_path / "l" / "step-0.safetensors", policy_logits=capped["zp"], reference_logits=capped["zr"],
              **common)
    save_step(tmp_path / "h" / "step-0.safetensors", policy_hidden=s["hp"], reference_hidden=s["hr"],
              policy_weight=s["wp"], reference_weight=s["wr"], logit_softcap=cap, **common)
    a, b = (audit_folder(tmp_path / f).rows[0] for f in ("l", "h"))
    for name in ("exact", "expected_q", "expected_b", "se", "recomputed"):
        assert abs(getattr(a, name) - getattr(b, name)) <= 1e-12 * (1 + abs(getattr(a, name))), name


def test_saved_steps_read_the_same_with_or_without_proc(folders, monkeypatch):
    """A step file is mapped through /proc/self/fd (the regular file opened is the one read); where /proc is
    missing its bytes are read and parsed: the same tensors and metadata either way, and a bad file is the
    same one line."""
    from kl_bench.audit import saved
    dirs, _ = folders
    files = sorted(dirs["hidden"].glob("*.safetensors"))
    mapped = [saved._load(f) for f in files]

    class NoProc(type(dirs["hidden"])):
        def exists(self, *a, **k):
            return not str(self).startswith("/proc/") and super().exists(*a, **k)
    monkeypatch.setattr(saved, "Path", NoProc)
    for f, (tensors, meta) in zip(files, mapped):
        t2, m2 = saved._load(f)
        assert meta == m2 and tensors.keys() == t2.keys() and all(torch.equal(tensors[k], t2[k]) for k in tensors)
    (dirs["hidden"] / "step-0009.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")
    with pytest.raises(kl_bench.SpecError, match="step-0009.safetensors.*cannot read"):
        saved._load(dirs["hidden"] / "step-0009.safetensors")


def test_the_audit_does_not_replace_another_kinds_folder(folders, tmp_path):
    """`kl-bench audit DIR --out RUN` over a run's results folder had deleted its summary.csv: one line, exit 2."""
    dirs, _ = folders
    spec = tmp_path / "g.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "g"\ndraws = 2000\nbatches = 10\ndevice = "cpu"\n'
                    '[[case]]\nname = "g"\nkind = "gaussian"\nq = { mean = 0.0, std = 1.0 }\np = { mean = 0.2, std = 1.0 }\n')
    assert runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "run"), "-q"]).exit_code == 0
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    res = runner.invoke(app, ["audit", str(dirs["logits"]), "--out", str(tmp_path / "run")])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "holds kl-bench run results" in lines[0], res.output
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
