"""kind = "model" on two tiny random GPT-2 models built in the test (no download): next-token exact truth
against an independent forward pass, continuations against the Rao–Blackwellised `full` reference, T = 1
against the next-token case, chunk independence, and one-line errors for bad input."""
import math
import subprocess
import sys

import pytest
import torch

import kl_bench
from kl_bench.api import prepare
from kl_bench.engine.monte_carlo import run_case
from kl_bench.foundation.errors import SpecError
from kl_bench.results import to_frame
from kl_bench.experiment.rows import summarize
from kl_bench.cli import app

from .conftest import CPU, model_case
from .helpers import HOOKS, one_line, runner

pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(cases, draws=1024, batches=16, estimators=("k1", "k2", "k3", "full")) -> dict:
    return {"spec_version": 1,
            "experiment": {"name": "model", "draws": draws, "seed": 3, "batches": batches, "device": "cpu",
                           "estimators": list(estimators)},
            "case": cases}


def _independent_logprobs(folder, prompts) -> torch.Tensor:
    """log-softmax of the last position of each prompt alone (no padding, no cache), float64 [B, V]."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        return torch.stack([torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, -1].double(), -1)
                            for p in prompts])


def test_next_token_truth_is_an_exact_sum_over_the_vocabulary(tiny_models):
    pair = prepare(_spec([model_case(tiny_models)])).pairs[0]
    from kl_bench.kinds.model import lm
    prompts = lm.read_prompts(tiny_models / "prompts.txt", tiny_models / "policy")
    lq = _independent_logprobs(tiny_models / "policy", prompts)
    lp = _independent_logprobs(tiny_models / "reference", prompts)
    assert pair.kind == "model" and pair.model.contexts == len(prompts) and pair.model.vocab == 1000
    # Batched, left-padded forwards agree with one prompt at a time to float32 rounding.
    assert torch.allclose(pair.model.log_q, lq, atol=1e-5) and torch.allclose(pair.model.log_p, lp, atol=1e-5)
    kl = float((lq.exp() * (lq - lp)).sum(-1).mean())           # float64 sum over the vocabulary
    fwd = float((lp.exp() * (lp - lq)).sum(-1).mean())
    assert pair.kl() == pytest.approx(kl, rel=1e-5) and pair.kl_forward() == pytest.approx(fwd, rel=1e-5)
    df = kl_bench.run(_spec([model_case(tiny_models)], draws=200_000, batches=50)).summary
    assert (df["true_kl"][df.target == "KL(q||p)"] == pair.kl()).all()
    assert df["z"].abs().max() < 5, df[["estimator", "mean", "exact_mean", "z"]]


def test_next_token_exact_means_of_unbiased_rows_equal_the_truth(tiny_models):
    # The truth and the exact means come from the same float64-normalised tables: k1, k3 and full are
    # unbiased, so their exact_rel_bias is float64 rounding (float32-normalised tables gave ~3e-8).
    df = kl_bench.run(_spec([model_case(tiny_models)], draws=256)).summary
    rev = df[df.target == "KL(q||p)"].set_index("estimator")
    for est in ("k1", "k3", "full"):
        assert abs(rev.loc[est, "exact_rel_bias"]) < 1e-13, (est, rev.loc[est, "exact_rel_bias"])
    pair = prepare(_spec([model_case(tiny_models)])).pairs[0]
    for lt in (pair.model.log_q, pair.model.log_p):
        assert (lt.exp().sum(-1) - 1).abs().max() < 1e-13


def test_continuations_agree_with_the_full_reference(tiny_models):
    res = kl_bench.run(_spec([model_case(tiny_models, length=6)], draws=1024))
    df = res.summary.set_index(["estimator", "aggregate"])
    ref = df.loc[("full", "tok")]
    assert math.isnan(ref["true_kl"]) and ref["ref_kl"] == ref["mean"] and ref["ref_se"] > 0
    for row in [("k1", "seq"), ("k3", "seq"), ("k1", "tok"), ("k3", "tok")]:
        assert abs(df.loc[row, "z_ref"]) < 5, (row, df.loc[row, ["mean", "se", "z_ref"]])
        assert math.isnan(df.loc[row, "z"]) and math.isnan(df.loc[row, "exact_mean"])   # never called exact
    # The analytic per-step KL has a lower variance than Σ_t k1 (Rao–Blackwell).
    assert ref["std"] < df.loc[("k1", "seq"), "std"]
    assert "not exact" in res.envelope["cases"]["m"]["reference"]
    # Growth in T from the prefixes of the same paths: at t = 1 the sequence and token k3 coincide.
    growth = res.envelope["cases"]["m"]["growth"]
    assert growth["T"] == [1, 2, 4, 6]
    assert growth["seq k3"][0] == pytest.approx(growth["tok k3"][0], rel=1e-12)
    _growth_matches_summary(growth, df, 1024)


def _growth_matches_summary(growth, df, draws):
    """The growth figure uses exactly the main pass's paths (not the pilot's or the small-batch stream's):
    at t = T its std/ref is summary.csv's std / ref_kl for the same rows (population vs sample std only)."""
    assert growth["paths"] == draws
    ref = df.loc[("full", "tok"), "ref_kl"]
    for label in ("seq k1", "seq k3", "tok k3", "tok full"):
        agg, est = label.split()
        assert growth[label][-1] == pytest.approx(df.loc[(est, agg), "std"] / ref, rel=2 / draws), label


def test_growth_uses_the_main_pass_only_and_never_depends_on_chunk(tiny_models):
    # cv_opt adds a pilot pass; the small-batch simulation draws its own stream: neither enters growth.
    spec = _spec([model_case(tiny_models, length=4, batch_size=16)], draws=96, batches=3,
                 estimators=("k1", "k3", "full"))
    spec["experiment"]["lambdas"] = ["optimal"]
    envs = []
    for chunk in (16, 1 << 20):
        spec["experiment"]["chunk"] = chunk
        res = kl_bench.run(spec)
        envs.append(res.envelope["cases"]["m"]["growth"])
        _growth_matches_summary(envs[-1], res.summary.set_index(["estimator", "aggregate"]), 96)
    assert envs[0] == envs[1]


def test_one_token_continuations_reproduce_the_next_token_case(tiny_models):
    nxt = prepare(_spec([model_case(tiny_models)])).pairs[0]
    cont = prepare(_spec([model_case(tiny_models, length=2)])).pairs[0]
    cont.length = 1
    n = 100
    draws = cont.generate(n, torch.Generator().manual_seed(5), CPU)
    idx = torch.randint(nxt.model.contexts, (n,), generator=torch.Generator().manual_seed(5))
    kl_ctx = (nxt.model.log_q.exp() * (nxt.model.log_q - nxt.model.log_p)).sum(-1)
    assert torch.allclose(draws.full, kl_ctx[idx], rtol=1e-6, atol=1e-9)
    # log r of the drawn token is an entry of the next-token table of its prompt
    table = (nxt.model.log_p - nxt.model.log_q)[idx]
    assert ((table - draws.logr[:, None]).abs().min(-1).values < 1e-6).all()


def test_chunk_never_changes_the_continuation_sums(tiny_models):
    pair = prepare(_spec([model_case(tiny_models, length=3, batch_size=16)])).pairs[0]
    runs = [run_case(pair, ["k1", "k3", "full"], draws=96, seed=1, batches=3, chunk=c, device=CPU, joint=True)
            for c in (1, 40, 1 << 22)]
    assert torch.equal(runs[0].sums, runs[1].sums) and torch.equal(runs[0].sums, runs[2].sums)


def test_sampler_with_and_without_weights(tiny_models):
    base = model_case(tiny_models, length=4, eos=0)
    rows = {}
    for w in ("none", "token", "sequence"):
        spec = _spec([{**base, "sampler": {"temperature": 1.3, "min_length": 2, "weights": w}}], draws=256,
                     estimators=("k1", "full"))
        pair = prepare(spec).pairs[0]
        assert pair.has_sampler and "T=1.3" in pair.describe()
        rows[w] = to_frame(summarize(run_case(pair, ["k1", "full"], draws=256, seed=0, batches=4, chunk=1 << 20,
                                              device=CPU)))
    assert all(df["mean"].notna().all() for df in rows.values())
    # Only sequence weights make the full mean a reference for KL(q‖p) under a sampler.
    assert rows["none"]["ref_kl"].isna().all() and rows["token"]["ref_kl"].isna().all()
    assert rows["sequence"]["ref_kl"].notna().all()


@pytest.mark.parametrize("keys, match", [
    ({"policy": "/nonexistent/policy"}, "key 'policy': model folder not found"),
    ({"prompts": "/nonexistent/prompts.txt"}, "key 'prompts': prompts file not found"),
    ({"length": 0}, "key 'length': must lie in"),
    ({"dtype": "int8"}, "key 'dtype': must be one of"),
    ({"eos": 5000}, "key 'eos': must be a token id in [0, 1000)"),
    ({"temperatur": 1.0}, "unknown key"),
    ({"sampler": {"min_length": 2}}, "min_length needs an eos token"),
])
def test_bad_model_cases_are_one_line_errors(tiny_models, keys, match):
    with pytest.raises(SpecError) as e:
        prepare(_spec([{**model_case(tiny_models), **keys}]))
    assert match in str(e.value) and "\n" not in str(e.value)


def test_bad_jsonl_prompts(tiny_models, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"ids": [1, 2]}\n')
    with pytest.raises(SpecError, match="line 1 is not a JSON object with 'input_ids'"):
        prepare(_spec([model_case(tiny_models, prompts=str(bad))]))


@pytest.mark.slow
def test_cli_missing_model_is_exit_2(tiny_models, tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text(f'spec_version = 1\n[experiment]\nname = "x"\ndraws = 100\n[[case]]\nname = "m"\nkind = "model"\n'
                    f'policy = "missing"\nreference = "{tiny_models / "reference"}"\nprompts = "{tiny_models / "prompts.txt"}"\n')
    out = subprocess.run([sys.executable, "-m", "kl_bench", "run", str(spec), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "case 'm': key 'policy': model folder not found" in out.stderr + out.stdout


def test_no_generation_call_exceeds_batch_size(tiny_models, monkeypatch):
    """Memory is one generation batch (batch_size continuations), whatever the engine's batch."""
    from kl_bench.kinds.model import ModelPair
    pair = prepare(_spec([model_case(tiny_models, length=2, batch_size=16)])).pairs[0]
    seen, orig = [], ModelPair.generate

    def spy(self, n, *args, **kwargs):
        seen.append(n)
        return orig(self, n, *args, **kwargs)
    monkeypatch.setattr(ModelPair, "generate", spy)
    run_case(pair, ["k1", "full"], draws=100, seed=0, batches=2, chunk=1 << 22, device=CPU)
    assert max(seen) == 16 and sum(seen) == 100


def test_dump_logits_feeds_categorical_and_logprobs_cases(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from kl_bench.cli import app
    out = tmp_path / "dump"
    r = CliRunner().invoke(app, ["dump-logits", "--policy", str(tiny_models / "policy"), "--reference",
                                 str(tiny_models / "reference"), "--prompts", str(tiny_models / "prompts.jsonl"),
                                 "--out", str(out), "--length", "4", "--samples", "300", "--eos", "0",
                                 "--device", "cpu"])
    assert r.exit_code == 0, r.output
    nt = str(out / "next_token.pt")
    cat = prepare(_spec([{"name": "c", "kind": "categorical", "q": {"file": nt, "key": "policy"},
                          "p": {"file": nt, "key": "reference"}}])).pairs[0]
    model = prepare(_spec([model_case(tiny_models)])).pairs[0]
    # The file holds the float32 log-probs both pairs renormalise in float64: the very same tables.
    assert torch.equal(cat.model.log_q, model.model.log_q) and torch.equal(cat.model.log_p, model.model.log_p)
    assert cat.kl() == model.kl() and cat.kl_forward() == model.kl_forward()
    data = torch.load(out / "continuations.pt")
    assert data["logp_policy"].shape == data["mask"].shape == (300, 4)
    df = kl_bench.run(_spec([{"name": "l", "kind": "logprobs", "file": str(out / "continuations.pt")}],
                            draws=20_000)).summary.set_index(["estimator", "aggregate"])
    for row in [("k1", "seq"), ("k3", "tok")]:
        assert abs(df.loc[row, "z_ref"]) < 5
    bad = CliRunner().invoke(app, ["dump-logits", "--policy", str(tmp_path / "none"), "--reference", "x",
                                   "--prompts", "y", "--out", str(out)])
    assert bad.exit_code == 2 and "model folder not found" in bad.output


@pytest.mark.slow
def test_report_of_cases_without_an_exact_value(tiny_models, tmp_path):
    """Figures of model continuations (with λ rows) and of logs with and without kl_full render."""
    from .test_trainer_inputs import _log
    no_kl = _log(60)
    del no_kl["kl_full"]
    spec = _spec([model_case(tiny_models, "T3", length=3), {"name": "log", "kind": "logprobs", **_log(60)},
                  {"name": "bare", "kind": "logprobs", **no_kl}], draws=256, batches=4)
    spec["experiment"]["lambdas"] = [0.5, "optimal"]
    res = kl_bench.run(spec)
    res.write(tmp_path / "out")
    report = res.report(tmp_path / "rep")
    figures = {p.name for p in (tmp_path / "rep" / "figures").iterdir()}
    assert report.exists() and "growth_T3.png" in figures and "bias_std_T3.png" in figures


def test_tables_of_continuations_show_measured_values_against_the_reference(tiny_models):
    """No exact value: no empty brackets in the terminal tables; the paper table shows the measured values
    against the Monte Carlo reference (KL ≈), its exact cells —; the description names the prompts once."""
    from rich.console import Console

    from kl_bench.present import side_tables as display, report_document, report_md
    spec = _spec([model_case(tiny_models), model_case(tiny_models, "T3", length=3)], draws=128, batches=4)
    res = kl_bench.run(spec)
    df = res.summary
    console = Console(width=300, record=True)
    console.print(display.schulman_table(df[df["lambda"].isna()]))
    console.print(display.rollout_table(df, {"T3": 3}))
    text = console.export_text()
    assert "()" not in text and "≈" in text and "Monte Carlo" in text
    t3 = df[(df["case"] == "T3") & (df["estimator"] == "k1") & (df["aggregate"] == "seq")].iloc[0]
    assert f"≈{display.fmt(t3['std'] / t3['ref_kl'])}" in text
    d = df.assign(key=df["case"], label=[kl_bench.core.draws.row_label(r) for _, r in df.iterrows()])
    cases, rows = report_document.paper_table(d)
    md = report_md.table_md(cases, rows, "caption")
    assert "T3 (KL ≈ " in md and "m (KL = " in md
    cells = dict(rows)["seq k1"][[c[0] for c in cases].index("T3")]
    assert cells[0] != "—" and cells[1] == "—" and cells[2] != "—" and cells[3] == "—"
    value, se = cells[0].rstrip("†").split(" ± ")         # measured ± SE (against the reference), in %
    assert value.endswith("%") and math.isfinite(float(value.rstrip("%"))) and float(se.rstrip("%")) > 0
    desc = res.envelope["cases"]["m"]["description"]
    assert desc.count("prompts") == 1, desc


def test_dump_logits_reports_progress_per_phase(tiny_models, tmp_path, monkeypatch):
    """Issue 25 item 9: dump-logits tells its progress (prompts, then continuations) with the total known."""
    from kl_bench.foundation import progress as P
    from kl_bench.kinds.model.dump import dump_logits
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", -1.0)
    import io

    from rich.console import Console
    buf = io.StringIO()
    bar = P.LazyProgress(0, enabled=True, console=Console(file=buf, force_terminal=True, width=400), unit="rows")
    labels = []
    shown = bar.label
    bar.label = lambda text: (labels.append(text), shown(text))[-1]
    dump_logits(tiny_models / "policy", tiny_models / "reference", tiny_models / "prompts.jsonl", tmp_path / "d",
                length=3, samples=40, device="cpu", batch_size=16, progress=bar)
    n_prompts = len((tiny_models / "prompts.jsonl").read_text().splitlines())
    bar.close()
    assert bar.total == n_prompts + 40 and bar.done == bar.total
    assert labels == ["next-token log-probs", "continuations of 3 tokens"]
    assert f"{bar.total:,}/{bar.total:,} rows" in buf.getvalue()


def test_a_monte_carlo_reference_prints_the_se_its_z_uses(tiny_models):
    """Model continuations (no exact value; the reference is the `full` mean of the same paths): the bias
    shown is mean − ref and its ± is the SE of that paired difference, recomputed here from batches.csv's
    batch means (the formula of docs/statistics.md#batch-means), so that z = bias / SE as printed."""
    from kl_bench.present.case_tables import compact_frame
    from kl_bench.foundation.formatting import fmt, measured_cells
    from kl_bench.core.stats import batch_means_se
    spec = {"spec_version": 1, "experiment": {"name": "m", "draws": 1024, "seed": 3, "batches": 16, "device": "cpu",
                                              "estimators": ["k1", "k2", "k3", "full"]},
            "case": [model_case(tiny_models, length=6)]}
    res = kl_bench.run(spec)
    df = res.summary.set_index(["estimator", "aggregate"])
    b = res.batches
    full = b[(b["estimator"] == "full")]["batch_mean"].to_numpy()
    sizes = b[(b["estimator"] == "full")]["draws"].to_numpy(dtype=float)
    shown = compact_frame(res.summary, "m").set_index("estimator")
    ref = df.loc[("full", "tok"), "ref_kl"]
    for est, agg in [("k1", "seq"), ("k2", "seq"), ("k3", "tok")]:
        r = df.loc[(est, agg)]
        m = b[(b["estimator"] == est) & (b["aggregate"] == agg)]["batch_mean"].to_numpy() - full
        w = sizes / sizes.sum()
        se = batch_means_se(m - float((w * m).sum()), w)
        assert r["ref_diff"] == pytest.approx(r["mean"] - ref, rel=1e-12, abs=1e-15)
        assert r["ref_diff_se"] == pytest.approx(se, rel=1e-9)
        assert r["z_ref"] == pytest.approx(r["ref_diff"] / r["ref_diff_se"], rel=1e-9)
        cell = shown.loc[f"{agg} {est}"]
        value, value_se, _ = measured_cells(100 * r["ref_diff"] / ref, 100 * se / ref, sign=True, unit="%")
        assert cell["bias/true ± se"] == f"{value} ± {value_se}"          # the one digit rule, the SE z uses
        assert cell["z"] == fmt(r["z_ref"], 2) and cell["n ±10%"] == "—"
    assert len(full) == 16 and all(math.isfinite(x) for x in full)


@pytest.mark.parametrize("name, content, needle", [("config.json", "{bad", "config.json is not valid JSON"),
                                                   ("tokenizer_config.json", "[", "is not valid JSON"),
                                                   ("config.json", "fifo", "is a FIFO (named pipe)")])
def test_a_bad_file_in_a_model_folder_names_the_spec_case_key_and_file(tiny_models, tmp_path, name, content, needle):
    """A config.json that is not JSON named the model's file only, not the spec, the case or the key."""
    import os
    import shutil
    model = tmp_path / "policy"
    shutil.copytree(tiny_models / "policy", model)
    (model / name).unlink()
    if content == "fifo":
        os.mkfifo(model / name)
    else:
        (model / name).write_text(content)
    spec = tmp_path / "m.toml"
    spec.write_text(f'spec_version = 1\n[experiment]\nname = "m"\ndraws = 64\n[[case]]\nname = "nt"\nkind = "model"\n'
                    f'policy = "policy"\nreference = "{tiny_models / "reference"}"\nprompts = "{tiny_models / "prompts.txt"}"\n')
    from typer.testing import CliRunner

    from kl_bench.cli import app
    res = CliRunner().invoke(app, ["exact", str(spec)])
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1, res.output
    assert f"{spec}: case 'nt': key 'policy': {model / name}: " in err and needle in err, err


def test_dump_logits_writes_its_folder_whole_and_a_full_disk_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    """dump-logits wrote next_token.pt, then continuations.pt: a disk that filled between left one of them."""
    from typer.testing import CliRunner

    from kl_bench.foundation import atomic
    from kl_bench.cli import app
    args = ["dump-logits", "--policy", str(tiny_models / "policy"), "--reference", str(tiny_models / "reference"),
            "--prompts", str(tiny_models / "prompts.jsonl"), "--length", "2", "--device", "cpu", "-q"]
    out = tmp_path / "a" / "dump"
    write, calls = atomic._write_file, []

    def second_fails(fh, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(fh, data)
    monkeypatch.setattr(atomic, "_write_file", second_fails)
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0, res.output
    assert "No space left on device" in res.stderr and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(atomic, "_write_file", write)
    assert CliRunner().invoke(app, [*args, "--out", str(out)]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["continuations.pt", "next_token.pt"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["dump"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["start", "pairs", "write", "staged", "written"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_at_every_phase_of_dump_logits_is_one_line(tiny_models, tmp_path, phase, sig):
    import os
    out = tmp_path / "dump"
    proc = subprocess.run([sys.executable, HOOKS, "dump-logits", "--policy",
                           str(tiny_models / "policy"), "--reference", str(tiny_models / "reference"), "--prompts",
                           str(tiny_models / "prompts.jsonl"), "--out", str(out), "-q", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KL_BENCH_SELF_SIGNAL": f"{phase}:{sig}"})
    err = proc.stderr.strip()
    assert proc.returncode == 130 and len(err.splitlines()) == 1 and "Traceback" not in err, (proc.returncode, err)
    assert out.exists() == (phase == "written") and sorted(os.listdir(tmp_path)) == (["dump"] if out.exists() else [])
    assert ("complete" in err) == (phase == "written"), err


# ----------------------------------------------------------------------------- 1. dump-logits: vocabularies
@pytest.fixture(scope="module")
def wide_reference(tiny_models, tmp_path_factory):
    """A random causal LM with vocabulary 1200 (the tiny policy has 1000), saved locally: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=1200, n_positions=64, n_embd=16, n_layer=1, n_head=1, bos_token_id=0,
                        eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval()
    out = tmp_path_factory.mktemp("wide") / "reference"
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("more", [[], ["--length", "4", "--samples", "32"]])
def test_dump_logits_refuses_models_of_two_vocabularies(tiny_models, wide_reference, tmp_path, more):
    """A reference of vocabulary 1200 beside a policy of 1000 had written [16, 1000] and [16, 1200] tensors
    (exit 0), and with --length 4 stopped with a traceback from the continuation's step."""
    out = tmp_path / "d"
    res = runner.invoke(app, ["dump-logits", "--policy", str(tiny_models / "policy"), "--reference",
                              str(wide_reference), "--prompts", str(tiny_models / "prompts.txt"), "--out", str(out),
                              "--quiet", *more])
    assert one_line(res) == "error: key '--reference': the reference has vocabulary 1200 but the policy has 1000"
    assert not out.exists()


def test_a_model_case_refuses_models_of_two_vocabularies_as_before(tiny_models, wide_reference, write_spec):
    spec = write_spec(f"""
        spec_version = 1
        [experiment]
        name = "m"
        draws = 64
        device = "cpu"
        [[case]]
        name = "lm"
        kind = "model"
        policy = "{tiny_models / 'policy'}"
        reference = "{wide_reference}"
        prompts = "{tiny_models / 'prompts.txt'}"
    """)
    with pytest.raises(SpecError, match="key 'reference': the reference has vocabulary 1200 but the policy has 1000"):
        kl_bench.run(spec)


def test_sampled_token_proxies_on_model_cases(tiny_models):
    """bin_kl and bin_tv (docs/gates.md) on the models: next-token rows exact (the vocabulary sums of the
    proxies of both models' log-probs), continuation rows against the reference, never called exact."""
    from kl_bench.core.estimators import ESTIMATORS
    nxt = kl_bench.run(_spec([model_case(tiny_models)], draws=256, estimators=("k3", "bin_kl", "bin_tv")))
    pair = nxt.pairs[0]
    lq, lp = pair.model.log_q, pair.model.log_p
    rows = nxt.summary.set_index("estimator")
    for name in ("bin_kl", "bin_tv"):
        want = float((lq.exp() * ESTIMATORS[name].on(lp - lq, lq)).sum(-1).mean())
        assert rows.loc[name, "exact_mean"] == pytest.approx(want, rel=1e-12)
        assert abs(rows.loc[name, "z"]) < 5
    assert rows.loc["bin_tv", "true_kl"] == pytest.approx(float(0.5 * (lq.exp() - lp.exp()).abs().sum(-1).mean()),
                                                          rel=1e-12)
    cont = kl_bench.run(_spec([model_case(tiny_models, length=2)], draws=128, estimators=("full", "bin_kl")))
    df = cont.summary.set_index(["estimator", "aggregate"])
    row = df.loc[("bin_kl", "tok")]
    assert math.isnan(row["exact_mean"]) and 0 < row["mean"] < df.loc[("full", "tok"), "mean"]
