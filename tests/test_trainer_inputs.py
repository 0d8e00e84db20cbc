"""The inputs trainers already have: [B, T, V] logits with a mask, .safetensors, a .pt dict with a key, and
logged per-token log-probs (kind = "logprobs", where the truth is unknown)."""

import numpy as np
import pytest
import torch

import kl_bench
from kl_bench.api import prepare
from kl_bench.foundation.errors import SpecError
from kl_bench.core.oracles import categorical_kl

G = torch.Generator().manual_seed(0)
B, T, V = 4, 5, 30
ZQ = torch.randn(B, T, V, generator=G, dtype=torch.float64)
ZP = ZQ + 0.4 * torch.randn(B, T, V, generator=G, dtype=torch.float64)
MASK = (torch.arange(T)[None] < torch.tensor([5, 2, 3, 1])[:, None])


def _spec(case, draws=20_000, estimators=("k1", "k3", "full")):
    return {"spec_version": 1, "experiment": {"name": "t", "draws": draws, "batches": 20, "device": "cpu",
                                              "estimators": list(estimators)},
            "case": [{"name": "c", **case}]}


def _expected_kl():
    lq, lp = torch.log_softmax(ZQ[MASK], -1), torch.log_softmax(ZP[MASK], -1)
    return categorical_kl(lq, lp)


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "npy"])
def test_btv_logits_with_a_mask_are_one_context_per_unmasked_position(tmp_path, fmt):
    if fmt == "safetensors":
        st = pytest.importorskip("safetensors.torch")
        st.save_file({"logits": ZQ.float(), "ref": ZP.float(), "attention_mask": MASK}, str(tmp_path / "d.safetensors"))
        q = {"file": str(tmp_path / "d.safetensors"), "key": "logits", "mask": str(tmp_path / "d.safetensors"),
             "mask_key": "attention_mask"}
        p = {**q, "key": "ref"}
    elif fmt == "pt":
        torch.save({"logits": ZQ, "ref_logits": ZP, "mask": MASK}, tmp_path / "d.pt")
        q = {"file": str(tmp_path / "d.pt"), "key": "logits", "mask": str(tmp_path / "d.pt"), "mask_key": "mask"}
        p = {**q, "key": "ref_logits"}
    else:
        np.save(tmp_path / "q.npy", ZQ.numpy())
        np.save(tmp_path / "p.npy", ZP.numpy())
        np.save(tmp_path / "m.npy", MASK.numpy())
        q = {"file": str(tmp_path / "q.npy"), "mask": str(tmp_path / "m.npy")}
        p = {"file": str(tmp_path / "p.npy"), "mask": str(tmp_path / "m.npy")}
    pair = prepare(_spec({"kind": "categorical", "q": q, "p": p})).pairs[0]
    assert pair.model.contexts == int(MASK.sum()) and pair.model.vocab == V
    tol = 1e-6 if fmt == "safetensors" else 1e-12          # float32 storage
    assert pair.kl() == pytest.approx(_expected_kl(), rel=tol)
    df = kl_bench.run(_spec({"kind": "categorical", "q": q, "p": p})).summary
    assert df["z"].abs().max() < 5


@pytest.mark.parametrize("change, match", [
    ({"key": "nope"}, "no tensor named 'nope'"),
    ({"key": None}, "name one with key"),
    ({"mask_key": "logits"}, "mask has shape [4, 5, 30] but the logits are [4, 5, 30]"),
    ({"mask": "/nonexistent.pt"}, "mask file not found"),
])
def test_bad_trainer_files_are_one_line_errors(tmp_path, change, match):
    torch.save({"logits": ZQ, "mask": MASK}, tmp_path / "d.pt")
    q = {"file": str(tmp_path / "d.pt"), "key": "logits", "mask": str(tmp_path / "d.pt"), "mask_key": "mask"}
    q = {k: v for k, v in {**q, **change}.items() if v is not None}
    with pytest.raises(SpecError) as e:
        prepare(_spec({"kind": "categorical", "q": q, "p": {"from": "q", "noise": 0.1}}))
    assert match in str(e.value) and "case 'c'" in str(e.value) and "key 'q" in str(e.value)


def _log(n=300, t=8, seed=0):
    """A trainer's log: per-token log-probs of sampled tokens under q and p, a mask, and kl_full."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(n, t, 20, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(n, t, 20, generator=g, dtype=torch.float64), -1)
    x = torch.multinomial(lq.exp().reshape(-1, 20), 1, generator=g).reshape(n, t)
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (n,), generator=g)[:, None]).double()
    return {"logp_policy": lq.gather(-1, x[..., None])[..., 0], "logp_ref": lp.gather(-1, x[..., None])[..., 0],
            "mask": mask, "kl_full": (lq.exp() * (lq - lp)).sum(-1)}


def test_logprobs_kind_reports_what_the_log_supports(tmp_path):
    log = _log()
    torch.save(log, tmp_path / "log.pt")
    res = kl_bench.run(_spec({"kind": "logprobs", "file": str(tmp_path / "log.pt")}, estimators=("k1", "k2", "k3", "full")))
    df = res.summary.set_index(["estimator", "aggregate"])
    assert df["true_kl"].isna().all()                                      # the truth is unknown
    ref = float((log["mask"] * log["kl_full"]).sum(-1).mean())
    assert df["ref_kl"].iloc[0] == pytest.approx(ref, rel=1e-12)
    # Unbiased estimators agree with Σ kl_full over the log within the log's own SE; k2 need not.
    for row in [("k1", "seq"), ("k1", "tok"), ("k3", "seq"), ("k3", "tok")]:
        assert abs(df.loc[row, "z_ref"]) < 5, row
    # exact_* are exact moments over the logged sequences (what the draws resample)
    seq_k1 = -(log["mask"] * (log["logp_ref"] - log["logp_policy"])).sum(-1)
    assert df.loc[("k1", "seq"), "exact_mean"] == pytest.approx(float(seq_k1.mean()), rel=1e-12)
    assert abs(df.loc[("k1", "seq"), "z"]) < 5 and df.loc[("k1", "tok"), "frac_negative"] > 0
    assert "not exact" in res.envelope["cases"]["c"]["reference"]


def test_logprobs_without_kl_full_has_no_reference():
    log = _log(50)
    del log["kl_full"]
    df = kl_bench.run(_spec({"kind": "logprobs", **log}, estimators=("k1", "k3", "full"))).summary
    assert "full" not in set(df["estimator"]) and df["ref_kl"].isna().all()


@pytest.mark.parametrize("change, match", [
    ({"logp_ref": torch.zeros(3, 3)}, "key 'logp_ref': has shape [3, 3]"),
    ({"mask": torch.full((50, 8), 2.0)}, "key 'mask': must hold 0 and 1 only"),
    ({"logp_policy": torch.ones(50, 8)}, "log-probabilities must be ≤ 0"),
    ({"logp_policy": "x"}, "names a key ('x') but the case has no 'file'"),
    ({"bogus": 1}, "unknown key"),
])
def test_bad_logprobs_cases(change, match):
    with pytest.raises(SpecError) as e:
        prepare(_spec({"kind": "logprobs", **{**_log(50), **change}}))
    assert match in str(e.value) and "\n" not in str(e.value)


def test_logprobs_file_missing_key(tmp_path):
    torch.save({"logp_policy": torch.zeros(2, 2)}, tmp_path / "log.pt")
    with pytest.raises(SpecError, match="key 'logp_ref'.*no tensor named 'logp_ref'"):
        prepare(_spec({"kind": "logprobs", "file": str(tmp_path / "log.pt")}))


def test_the_reference_is_reported_whatever_the_estimators_list(tmp_path):
    """Issue 25 item 8: without `full` in the estimators, a log with kl_full still reports ref_kl and z_ref
    (the reference row is added), and the advice names an estimator instead of "no finite RMSE"."""
    log = _log()
    with_full = kl_bench.run(_spec({"kind": "logprobs", **log}, estimators=("k1", "k3", "full"))).summary
    res = kl_bench.run(_spec({"kind": "logprobs", **log}, estimators=("k1", "k3")))
    df = res.summary
    assert "full" in set(df["estimator"])                       # the reference row, added
    k = df[df["estimator"].isin(["k1", "k3"])]
    assert k["ref_kl"].notna().all() and k["z_ref"].notna().all()
    cols = ["estimator", "aggregate", "mean", "ref_kl", "ref_se", "z_ref"]
    assert df[cols].reset_index(drop=True).equals(with_full[cols].reset_index(drop=True))
    value = [a for a in res.recommendations() if a.use == "value"][0]
    assert value.row and "no estimator" not in value.text and "Monte Carlo" in value.text
