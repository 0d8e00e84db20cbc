"""The cause named right (issue 43, item 7): a trainer whose per-token values are not its declared estimator
of its own log r (the sign of log r swapped, another estimator) gets a bias part of its own, `formula`,
named in a warning with the formula its values do fit, and `kl-bench audit` exits 1; a gap the dtype of its
values explains stays `precision`. Saved steps with float32 or bfloat16 values, no TRL."""
import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.audit.offline import audit_folder
from kl_bench.audit.saving import save_step
from kl_bench.audit.step import formula_name
from kl_bench.cli import app

pytest.importorskip("safetensors")
B, T, V = 4, 6, 50


def _save(folder, compute, estimator="trl.grpo", steps=3, own=False):
    """Steps whose tokens the policy drew, and the trainer's values ``compute(log q, log p)`` of its own
    float32 log-probs; ``own``: its log-probs saved beside them."""
    g = torch.Generator().manual_seed(0)
    folder.mkdir()
    for i in range(steps):
        zq = 1.5 * torch.randn(B, T, V, generator=g)
        zp = zq + 0.7 * torch.randn(B, T, V, generator=g)
        ids = torch.multinomial(torch.softmax(zq.double(), -1).view(-1, V), 1, generator=g).view(B, T)
        lq, lp = (torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1) for z in (zq, zp))
        extra = dict(policy_logprobs=lq, reference_logprobs=lp) if own else {}
        save_step(folder / f"step-{i:04d}.safetensors", completion_ids=ids, mask=torch.ones(B, T),
                  trainer_kl=compute(lq, lp), step=i, estimator=estimator, policy_logits=zq, reference_logits=zp,
                  **extra)
    return folder


def _k(name):
    return kl_bench.ESTIMATORS[name].fn


@pytest.mark.parametrize("declared, compute, fit", [
    ("trl.grpo", lambda lq, lp: _k("trl.grpo")(lq - lp), 1),      # log q − log p: the sign swapped
    ("k1", lambda lq, lp: _k("k1")(lq - lp), 1),
    ("trl.grpo", lambda lq, lp: _k("k1")(lp - lq), 2),            # another estimator
    ("trl.grpo", lambda lq, lp: _k("k2")(lp - lq), 4),
    ("k1", lambda lq, lp: _k("k3")(lp - lq), 6),
    ("k1", lambda lq, lp: _k("k3")(lq - lp), 7),
], ids=["k3-swapped", "k1-swapped", "k1-for-k3", "k2-for-k3", "k3-for-k1", "k3-swapped-for-k1"])
@pytest.mark.parametrize("own", [False, True], ids=["emulated", "own-logprobs"])
def test_a_wrong_formula_is_its_own_part_named_and_fails_the_audit(tmp_path, declared, compute, fit, own):
    folder = _save(tmp_path / "steps", compute, declared, own=own)
    rows = audit_folder(folder).rows
    for r in rows:
        assert r.formula_fit == fit and r.own_logprobs == (B * T if own else 0)
        # logged − recomputed is all formula, up to the float32 rounding of the log-probs (precision)
        assert abs(r.bias_precision) <= 2.0 ** -24 * 64 * (1 + abs(r.logged) + abs(r.recomputed))
        assert r.bias_formula + r.bias_precision == pytest.approx(r.logged - r.recomputed, rel=1e-12, abs=1e-15)
        assert (r.bias_estimator + r.bias_sampler + r.bias_mismatch + r.bias_formula + r.bias_precision + r.noise ==
                pytest.approx(r.bias, rel=1e-9, abs=1e-12))
    res = CliRunner().invoke(app, ["audit", str(folder)])
    assert res.exit_code == 1, res.output
    said = [x for x in res.output.splitlines() if "the trainer's values are not" in x]
    assert len(said) == 1 and formula_name(declared, fit) in said[0] and "precision" not in said[0].split(":")[0]
    assert "formula " in res.output.splitlines()[0]             # the step line shows the part


def test_the_right_formula_passes_and_exits_0(tmp_path):
    folder = _save(tmp_path / "steps", lambda lq, lp: _k("trl.grpo")(lp - lq))
    rows = audit_folder(folder).rows
    assert all(r.formula_fit == 0 and r.bias_formula == 0 and abs(r.z) < 5 for r in rows)
    res = CliRunner().invoke(app, ["audit", str(folder)])
    assert res.exit_code == 0 and "warning" not in res.output, res.output


def test_a_gap_the_dtype_explains_stays_precision(tmp_path):
    # The trainer computed its log-probs and k3 in bfloat16 (values saved as bfloat16): the gap to float64 is
    # rounding, far above float32's, and the audit labels it precision, with no formula warning.
    def bf16(lq, lp):
        return _k("trl.grpo")(lp.bfloat16() - lq.bfloat16())
    rows = audit_folder(_save(tmp_path / "steps", bf16)).rows
    assert all(r.formula_fit == 0 and r.bias_formula == 0 for r in rows)
    assert all(abs(r.bias_precision) > 2.0 ** -24 * 64 * (1 + abs(r.logged)) for r in rows)   # a real gap
    # the same trainer with its k3's sign swapped is still named, in bfloat16
    rows = audit_folder(_save(tmp_path / "swapped", lambda lq, lp: bf16(lp, lq))).rows
    assert all(r.formula_fit == 1 for r in rows)
