"""The rollout model (kl_bench.kinds.rollout.model): its phases, its table of weights options, its refusals."""
import pytest
import torch

from kl_bench.foundation.errors import SpecError
from kl_bench.kinds import CASE_KINDS
from kl_bench.kinds.rollout import RolloutModel, RolloutPair
from kl_bench.kinds.rollout.model import WEIGHTINGS


def _tables(c=2, v=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    return lq, lp, torch.arange(v) % c


def test_every_weights_option_of_the_kind_has_an_entry():
    assert set(WEIGHTINGS) == {"none", *CASE_KINDS["rollout"].weight_kinds}
    with pytest.raises(KeyError):
        RolloutModel.build(*_tables(), 3, 4, weights="tokens")


def test_min_length_makes_two_phases_with_eos_suppressed_in_the_first():
    lq, lp, bucket = _tables()
    model = RolloutModel.build(lq, lp, bucket, 5, 4, min_length=2)
    assert [steps for _, steps in model.phases] == [2, 3] and model.phase_of == [0, 0, 1, 1, 1]
    early, late = model.phases[0].log_b, model.phases[1].log_b
    assert torch.all(early[:, 4] == -torch.inf) and torch.allclose(early.exp().sum(-1), torch.ones(2, dtype=torch.float64))
    assert torch.equal(late, model.log_q) and model.has_sampler and model.support_miss > 0
    whole = RolloutModel.build(lq, lp, bucket, 2, 4, min_length=3)          # EOS suppressed throughout
    assert [steps for _, steps in whole.phases] == [2]


@pytest.mark.parametrize("min_length", [0, 2])
def test_a_sampler_that_draws_what_q_never_does_is_refused(min_length):
    lq, lp, bucket = _tables()
    lq = lq.clone()
    lq[:, 1] = -torch.inf
    lq = torch.log_softmax(lq, -1)
    lb = torch.log_softmax(torch.zeros(2, 5, dtype=torch.float64), -1)      # b draws token 1
    with pytest.raises(SpecError, match="the sampler draws tokens that q gives probability 0"):
        RolloutPair("r", lq, lp, bucket, 3, 4, log_b=lb, min_length=min_length)
    RolloutModel.build(lq, lp, bucket, 3, 4, log_b=lb, min_length=min_length)   # tables only: no value read
