"""`kl-bench audit DIR` on saved steps whose metadata or values the audit cannot compute from: each is one
line naming the file and the key, exit code 2, nothing written, never a traceback nor a vacuous verdict.
(A probe had found: a source listed twice counting every token twice, RecursionError on nested JSON,
top_k = true reaching torch.topk, NaN trainer values printing 'bias +nan' with exit 0, an all-zero mask
printing a '0 tokens ... z = +0.00' pass, and an estimator's error without the file name.)"""
import dataclasses
import math

import pytest
import torch
from typer.testing import CliRunner

from kl_bench.audit import Sampler
from kl_bench.audit.offline import audit_folder
from kl_bench.audit.saving import save_step
from kl_bench.audit.session import AuditSession, Metric
from kl_bench.cli import app
from kl_bench.foundation.errors import SpecError

pytest.importorskip("safetensors")
runner = CliRunner()
B, T, V, D = 2, 11, 5, 4
NAME = "step-0009.safetensors"


def _tensors(seed=0, hidden=False, **change):
    """A small valid step: random ids, logits (or hidden states with output layers) and trainer values."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(completion_ids=torch.randint(0, V, (B, T), generator=g), mask=torch.ones(B, T),
              trainer_kl=torch.rand(B, T, generator=g), step=9, estimator="k3")
    if hidden:
        kw.update(policy_hidden=torch.randn(B, T, D, generator=g), reference_hidden=torch.randn(B, T, D, generator=g),
                  policy_weight=torch.randn(V, D, generator=g), reference_weight=torch.randn(V, D, generator=g))
    else:
        kw.update(policy_logits=torch.randn(B, T, V, generator=g), reference_logits=torch.randn(B, T, V, generator=g))
    return {**kw, **change}


def _save(folder, name=NAME, meta=None, **change):
    """Save a step, then (``meta``) rewrite metadata entries as any safetensors writer could."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    folder.mkdir(exist_ok=True)
    path = save_step(folder / name, **_tensors(**change))
    if meta:
        with safe_open(str(path), "pt") as f:
            old = dict(f.metadata())
        save_file(load_file(str(path)), str(path), metadata={**old, **meta})
    return path


def _one_line(folder, *needles):
    res = runner.invoke(app, ["audit", str(folder)])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert str(folder / NAME) in lines[0] or any(str(p) in lines[0] for p in folder.glob("step-*")), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    assert not (folder / "audit").exists()
    return lines[0]


# --- 1. a source listed twice ---------------------------------------------------------------------------

def test_a_source_listed_twice_is_refused(tmp_path):
    _save(tmp_path, meta={"metrics": '[["kl","k3","token-mean"],["kl","k1","token-mean"]]'})
    _one_line(tmp_path, "key 'metrics': source 'kl' listed twice")


def test_a_later_metric_cannot_read_the_first_metrics_values(tmp_path):
    # trainer_kl holds the first metric's values: a later source 'kl' had read them as its own.
    _save(tmp_path, meta={"metrics": '[["loss","k3","token-mean"],["kl","k1","token-mean"]]'})
    _one_line(tmp_path, "key 'metrics'", "both read trainer_kl")


def test_the_audit_core_refuses_a_source_twice():
    with pytest.raises(SpecError, match="key 'metrics': source 'kl' listed twice"):
        AuditSession((None, None), [Metric("kl", "k3", "token-mean"), Metric("kl", "k1", "token-mean")])


@pytest.mark.parametrize("second, key", [(dict(estimator="k1"), "key 'metrics'"),
                                         (dict(micro_batches="mean"), "key 'metrics'"),
                                         (dict(generation={"top_k": 3}), "key 'generation.top_k'")])
def test_files_of_one_step_share_their_settings(tmp_path, second, key):
    # Two files of step 9 with other settings had made two rows of step 9 ('pooled kl over 2 steps').
    _save(tmp_path)
    _save(tmp_path, name="step-0009b.safetensors", seed=1, **second)
    _one_line(tmp_path, key, "step 9, source 'kl'", "step-0009.safetensors")


# --- 2. JSON from the file: the safe parser -------------------------------------------------------------

@pytest.mark.parametrize("key", ["generation", "metrics"])
def test_deeply_nested_metadata_is_one_line(tmp_path, key):
    _save(tmp_path, meta={key: "[" * 100_000 + "]" * 100_000})
    _one_line(tmp_path, f"key '{key}'", "nested too deeply")


@pytest.mark.parametrize("key, value, says", [
    ("metrics", '"abc"', "must be a JSON list of [source, estimator, aggregation]"),
    ("metrics", '[["kl","k3"]]', "must be a JSON list of [source, estimator, aggregation]"),
    ("metrics", "{not json", "not valid JSON"),
    ("generation", "[1]", "must be a JSON object"),
    ("step", "9" * 5000, "key 'step': must be an integer"),
    ("step", "٣", "key 'step': must be an integer"),              # int() reads Arabic-Indic digits as 3
    ("logit_scale", "x", "key 'logit_scale': must be a number"),
    ("notes", '[["dropout"]]', "must be a JSON list of [key, message] strings"),
    ("notes", '[["dropout", 1]]', "must be a JSON list of [key, message] strings"),
])
def test_bad_metadata_values_name_their_key(tmp_path, key, value, says):
    _save(tmp_path, meta={key: value})
    line = _one_line(tmp_path, f"key '{key}'", says)
    assert len(line) < 300


def test_a_deeply_nested_header_is_one_line_with_or_without_proc(tmp_path, monkeypatch):
    """The header read without /proc goes through the same safe parser (RecursionError had escaped)."""
    from kl_bench.audit import saved
    header = b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / NAME).write_bytes(len(header).to_bytes(8, "little") + header)
    _one_line(tmp_path, "cannot read")

    class NoProc(type(tmp_path)):
        def exists(self, *a, **k):
            return not str(self).startswith("/proc/") and super().exists(*a, **k)
    monkeypatch.setattr(saved, "Path", NoProc)
    with pytest.raises(SpecError, match=f"{NAME}.*cannot"):
        saved._load(tmp_path / NAME)


# --- 3. generation settings: each field's type ----------------------------------------------------------

@pytest.mark.parametrize("generation, key, says", [
    ('{"top_k": true}', "generation.top_k", "must be an integer"),
    ('{"top_k": 1.5}', "generation.top_k", "must be an integer"),
    ('{"temperature": [1]}', "generation.temperature", "must be a number"),
    ('{"temperature": "1"}', "generation.temperature", "must be a number"),
    ('{"temperature": true}', "generation.temperature", "must be a number"),
    ('{"temperature": null}', "generation.temperature", "must be a number"),
    ('{"top_p": "0.5"}', "generation.top_p", "must be a number"),
    ('{"min_p": false}', "generation.min_p", "must be a number"),
    ('{"repetition_penalty": null}', "generation.repetition_penalty", "must be a number"),
    ('{"repetition_penalty": 1e309}', "generation.repetition_penalty", "must be a finite number > 0"),
    ('{"min_new_tokens": 1.5, "eos_token_id": 1}', "generation.min_new_tokens", "must be an integer"),
    ('{"eos_token_id": "x"}', "generation.eos_token_id", "must be an integer token id"),
    ('{"eos_token_id": [1.5]}', "generation.eos_token_id", "must be an integer token id"),
    ('{"eos_token_id": true}', "generation.eos_token_id", "must be an integer token id"),
    ('{"eos_token_id": -1}', "generation.eos_token_id", "≥ 0"),
    ('{"eos_token_id": 7, "min_new_tokens": 2}', "generation.eos_token_id", f"outside the vocabulary [0, {V})"),
    ('{"top_p": 1.5}', "generation.top_p", "must lie in (0, 1]"),
    # logits / temperature past float64's range: the audit's numbers had been NaN, exit 0
    ('{"temperature": 1e-320}', "generation.temperature", "pass float64's range"),
    # integers past float64 (JSON holds any): OverflowError tracebacks from the range checks
    ('{"temperature": 1' + "0" * 400 + '}', "generation.temperature", "below 2^63"),
    ('{"repetition_penalty": 1' + "0" * 400 + '}', "generation.repetition_penalty", "below 2^63"),
    ('{"eos_token_id": [1' + "0" * 30 + ']}', "generation.eos_token_id", "below 2^63"),
])
def test_generation_settings_name_the_field(tmp_path, generation, key, says):
    _save(tmp_path, meta={"generation": generation})
    _one_line(tmp_path, f"key '{key}'", says)


@pytest.mark.parametrize("kw, key", [(dict(top_k=True), "sampler.top_k"), (dict(top_k=2.0), "sampler.top_k"),
                                     (dict(temperature="1"), "sampler.temperature"),
                                     (dict(temperature=False), "sampler.temperature"),
                                     (dict(eos_token_id=(1.0,)), "sampler.eos_token_id")])
def test_the_sampler_checks_types_in_the_python_api(kw, key):
    with pytest.raises(SpecError, match=f"key '{key}': must be (a number|an integer)"):
        Sampler(**kw)


def test_whole_numbers_and_nulls_still_read():
    s = Sampler.from_dict({"temperature": 1, "top_k": None, "top_p": None, "min_p": None, "eos_token_id": [2, 3],
                           "min_new_tokens": 1, "repetition_penalty": 1})
    assert s.eos_token_id == (2, 3) and s.top_k is None and s.temperature == 1


# --- 4. the values the audit reads ----------------------------------------------------------------------

@pytest.mark.parametrize("bad, shown", [(math.nan, "NaN"), (math.inf, "+inf"), (-math.inf, "-inf")])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_non_finite_trainer_values_at_counted_positions_are_refused(tmp_path, bad, shown, hidden):
    kl = _tensors()["trainer_kl"].clone()
    kl[1, 3] = bad
    _save(tmp_path, trainer_kl=kl, hidden=hidden)
    _one_line(tmp_path, "key 'trainer_kl'", f"holds {shown} at masked-in position [b, t] = [1, 3]")


@pytest.mark.parametrize("key, value", [
    ("engine_logprobs", lambda: -torch.rand(B, T).index_put_((torch.tensor(0), torch.tensor(2)), torch.tensor(-math.inf))),
    ("sampling_hidden", lambda: torch.randn(B, T, D).index_put_((torch.tensor(1), torch.tensor(0)),
                                                                torch.full((D,), math.nan))),
])
def test_other_per_token_values_are_finite_where_read(tmp_path, key, value):
    _save(tmp_path, hidden=key == "sampling_hidden", **{key: value()})
    _one_line(tmp_path, f"key '{key}'", "at masked-in position [b, t]")


def test_values_at_padding_are_not_read(tmp_path):
    """NaN where the mask is 0 is not refused, and the audit is the one of the same step with finite padding
    (equal, not close: padded positions never enter the sums)."""
    mask = torch.ones(B, T)
    mask[0, -3:] = 0
    kl = _tensors()["trainer_kl"].clone()
    _save(tmp_path / "finite", mask=mask, trainer_kl=kl)
    kl[0, -3:] = math.nan
    _save(tmp_path / "nan", mask=mask, trainer_kl=kl)
    a, b = (audit_folder(tmp_path / d).rows for d in ("finite", "nan"))
    assert a == b and a[0].tokens == int(mask.sum())


@pytest.mark.parametrize("key, dtype", [("trainer_kl", torch.int32), ("trainer_kl", torch.bool),
                                        ("policy_logits", torch.int64)])
def test_real_values_saved_as_integers_are_refused(tmp_path, key, dtype):
    # an integer trainer_kl had been read truncated (0.43 → 0), in silence
    shape = (B, T, V) if key.endswith("logits") else (B, T)
    _save(tmp_path, **{key: torch.ones(shape, dtype=dtype)})
    _one_line(tmp_path, f"key '{key}'", f"must hold floating-point values, got {dtype}")


@pytest.mark.parametrize("files", [1, 2])
def test_a_step_without_tokens_is_refused(tmp_path, files):
    for i in range(files):
        _save(tmp_path, name=f"step-0009{'b' * i}.safetensors", mask=torch.zeros(B, T), seed=i)
    _one_line(tmp_path, "key 'mask'", "step 9 has no masked-in token", "nothing to audit")


def test_a_file_without_tokens_pools_into_its_step(tmp_path):
    """One micro-batch with mask 0 everywhere beside one with tokens: under token-mean the step is the other
    file's audit, the empty file's rows counted as rows (sequences: the B a seq-mean divides by)."""
    _save(tmp_path / "both", seed=0)
    _save(tmp_path / "both", name="step-0009b.safetensors", seed=1, mask=torch.zeros(B, T))
    _save(tmp_path / "one", seed=0)
    (both,), (one,) = audit_folder(tmp_path / "both").rows, audit_folder(tmp_path / "one").rows
    assert both == dataclasses.replace(one, sequences=2 * B) and one.tokens == B * T


@pytest.mark.parametrize("change, key, says", [
    (dict(hidden=True, policy_bias=torch.zeros(V + 2)), "policy_bias", f"must be [V] with V = {V}"),
    (dict(hidden=True, reference_bias=torch.full((V,), math.nan)), "reference_bias", "NaN or infinite"),
    (dict(generation={"repetition_penalty": 1.2}, prompt_ids=torch.zeros(B, 3)), "prompt_ids", "integer ids [B, P]"),
    (dict(generation={"repetition_penalty": 1.2}, prompt_ids=torch.zeros(B + 1, 3, dtype=torch.long)), "prompt_ids",
     f"with B = {B}"),
])
def test_heads_and_prompts_are_checked(tmp_path, change, key, says):
    _save(tmp_path, **change)
    _one_line(tmp_path, f"key '{key}'", says)


# --- 5. every error names the file ----------------------------------------------------------------------

@pytest.mark.parametrize("metrics, key", [('[["kl",["k3"],"token-mean"]]', "estimator"),
                                          ('[["kl","k3",["token-mean"]]]', "aggregation"),
                                          ('[[1,"k3","token-mean"]]', "source"),
                                          ('[["kl","k33","token-mean"]]', "estimator"),
                                          ('[["kl","os:system","token-mean"]]', "estimator"),
                                          ('[["kl","k3","token-mean","average"]]', "micro_batches"),
                                          ('[["kl","k3","token-mean",1]]', "micro_batches")])
def test_metric_errors_name_the_file(tmp_path, metrics, key):
    _save(tmp_path, meta={"metrics": metrics})
    assert _one_line(tmp_path, f"key '{key}'").startswith(f"error: {tmp_path / NAME}: ")


def test_a_bad_micro_batches_entry_names_its_key(tmp_path):
    _save(tmp_path, meta={"micro_batches": "average"})
    _one_line(tmp_path, "key 'micro_batches'", "must be one of pooled, mean")


def test_files_of_one_step_average_when_the_trainer_averages_its_micro_batches(tmp_path):
    """micro_batches = "mean" (TRL's logged GRPO kl): a step of two files is the mean of the two files'
    own audits (se: the root of the sum of squares over 2), not the audit of their pooled tokens."""
    uneven = torch.ones(B, T)
    uneven[:, 3:] = 0                                   # 2·3 tokens here, 2·11 in the other file
    _save(tmp_path / "step", micro_batches="mean", mask=uneven)
    _save(tmp_path / "step", name="step-0009b.safetensors", seed=1, micro_batches="mean")
    _save(tmp_path / "a", micro_batches="mean", mask=uneven)
    _save(tmp_path / "b", name="step-0009b.safetensors", seed=1, micro_batches="mean")
    (got,), (a,), (b,) = (audit_folder(tmp_path / d).rows for d in ("step", "a", "b"))
    for name in ("logged", "exact", "expected_b", "bias", "bias_precision"):
        assert getattr(got, name) == pytest.approx((getattr(a, name) + getattr(b, name)) / 2, rel=1e-12), name
    assert got.se == pytest.approx(math.hypot(a.se, b.se) / 2, rel=1e-12) and got.tokens == a.tokens + b.tokens
    pooled = (a.logged * a.tokens + b.logged * b.tokens) / (a.tokens + b.tokens)
    assert abs(got.logged - pooled) > 1e-3 * abs(pooled)      # the files' token counts differ: not pooled


@pytest.mark.parametrize("what", ["file", "fifo", "missing"])
def test_dir_that_is_not_a_folder_is_named_itself(tmp_path, what):
    """DIR a file, a FIFO or nothing: the line names DIR and what it is (it named the DIR/audit it would
    have written, 'cannot be created'), exit 2, nothing made."""
    import os
    path = tmp_path / "steps"
    if what == "file":
        path.write_text("x")
    elif what == "fifo":
        os.mkfifo(path)
    res = runner.invoke(app, ["audit", str(path)])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    said = {"file": "is a regular file", "fifo": "is a FIFO (named pipe)", "missing": "does not exist"}[what]
    assert f"{path}: {said}: not a folder of saved steps" in lines[0], lines[0]
    assert "/audit" not in lines[0] and sorted(tmp_path.iterdir()) == ([] if what == "missing" else [path])


def test_saving_without_safetensors_is_one_line(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)        # an import of it now fails
    with pytest.raises(SpecError, match="saving steps needs the safetensors package: pip install safetensors"):
        save_step(tmp_path / NAME, **_tensors())
    assert not list(tmp_path.iterdir())
