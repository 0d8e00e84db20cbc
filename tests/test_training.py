"""Optimisation trajectories (kl_bench.training): exact trajectories against independent implementations,
the optimum q* reached, sampled trajectories around the exact one, determinism, and bad [train] input."""
import math

import pytest
import torch

import kl_bench
from kl_bench.foundation.errors import SpecError
from kl_bench.kinds.categorical.training import CategoricalProblem
from kl_bench.kinds.rollout.training import RolloutProblem
from kl_bench.training import Optimizer, parse_combination, run_trajectory, trajectory

from .helpers import HOOKS

STEPS = 60


def _logits(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(*shape, dtype=torch.float64, generator=g), -1)


def _categorical(b=3, v=12, beta=0.7, reward=True):
    r = torch.randn(b, v, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) if reward \
        else torch.zeros(b, v, dtype=torch.float64)
    return CategoricalProblem("c", _logits((b, v), 1), _logits((b, v), 2), r, beta)


def _thetas(pb, label, opt, steps=STEPS):
    combo = parse_combination(label, ())
    return [th for _, th, _ in trajectory(pb.theta0, opt, steps, lambda th, t: pb.expected_update(th, combo))]


def _objective(pb, theta):
    """J(θ) written independently: mean over contexts of E_q[reward] − β KL(q‖p)."""
    lq = torch.log_softmax(theta, -1)
    q = lq.exp()
    return ((q * pb.reward).sum(-1) - pb.beta * (q * (lq - pb.log_p)).sum(-1)).mean()


def _autograd_sgd(pb, lr, steps):
    theta, out = pb.theta0.clone(), []
    for _ in range(steps + 1):
        out.append(theta.clone())
        th = theta.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(_objective(pb, th), th)
        theta = theta + lr * g
    return out


def _autograd_adam(pb, lr, steps):
    # torch.optim.Adam on a local parameter: an independent Adam (its state lives in this optimiser only).
    th = torch.nn.Parameter(pb.theta0.clone())
    opt = torch.optim.Adam([th], lr=lr, maximize=True)
    out = []
    for _ in range(steps + 1):
        out.append(th.detach().clone())
        opt.zero_grad()
        _objective(pb, th).backward()
        opt.step()
    return out


@pytest.mark.parametrize("label", ["k1/reward", "k2/loss", "k3/loss_is", "k3/reward+loss"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_correct_modes_follow_autograd_of_the_true_objective(label, optimizer):
    pb = _categorical()
    lr = 0.5 if optimizer == "sgd" else 0.05
    ours = _thetas(pb, label, Optimizer(optimizer, lr))
    ref = (_autograd_sgd if optimizer == "sgd" else _autograd_adam)(pb, lr, STEPS)
    assert len(ours) == STEPS + 1
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert float((ours[-1] - ours[0]).abs().max()) > 0.1         # the policy did move


def _independent_kl_gradient(label, lq, lp):
    """∇θ of the KL term as each biased combination's expectation, written from the closed forms
    (DESIGN.md gradient table): k3 loss → ∇KL(p‖q) = q − p; k3 reward → E[k3 s]; k1 loss → 0. Per context."""
    q, p = lq.exp(), lp.exp()
    if label == "k3/loss":
        return q - p
    if label == "k3/reward":
        k3 = torch.expm1(lp - lq) - (lp - lq)
        return q * (k3 - (q * k3).sum(-1, keepdim=True))
    assert label == "k1/loss"
    return torch.zeros_like(q)


@pytest.mark.parametrize("label", ["k3/loss", "k3/reward", "k1/loss"])
def test_biased_modes_follow_their_closed_form(label):
    pb = _categorical()
    lr = 0.3
    ours = _thetas(pb, label, Optimizer("sgd", lr))
    theta = pb.theta0.clone()
    b = theta.shape[0]
    for t in range(STEPS + 1):
        assert torch.allclose(ours[t], theta, rtol=0, atol=1e-10)
        lq = torch.log_softmax(theta, -1)
        q = lq.exp()
        g_r = q * (pb.reward - (q * pb.reward).sum(-1, keepdim=True))
        theta = theta + lr * (g_r - pb.beta * _independent_kl_gradient(label, lq, pb.log_p)) / b


def test_k1_in_the_loss_never_moves_the_policy():
    pb = _categorical(reward=False)
    ours = _thetas(pb, "k1/loss", Optimizer("adam", 0.1))
    assert all(torch.equal(th, pb.theta0) for th in ours)


@pytest.mark.parametrize("label", ["k1/reward", "k2/loss"])
def test_categorical_optimum_is_reached(label):
    pb = _categorical(b=2, v=6, beta=1.0)
    combo = parse_combination(label, ())
    tr = run_trajectory(pb, Optimizer("sgd", 8.0), 150, 150, lambda th, t: pb.expected_update(th, combo))
    assert tr["kl_opt"][0] > 0.1
    assert tr["kl_opt"][-1] < 1e-12
    # At q*, KL(q*‖q*) = 0 and J = β log Z: the identity the rollout kind uses for its distance.
    log_z = torch.logsumexp(pb.log_p + pb.reward / pb.beta, -1).mean()
    assert abs(tr["objective"][-1] - pb.beta * float(log_z)) < 1e-10


def test_k3_in_the_loss_is_mass_covering():
    pb = _categorical(reward=True)
    fin = {}
    for label in ("k1/reward", "k2/loss", "k3/loss"):
        combo = parse_combination(label, ())
        tr = run_trajectory(pb, Optimizer("adam", 0.1), 150, 150, lambda th, t: pb.expected_update(th, combo))
        fin[label] = (tr["kl_rev"][-1], tr["kl_fwd"][-1])
    for other in ("k1/reward", "k2/loss"):
        assert fin["k3/loss"][1] < fin[other][1] and fin["k3/loss"][0] > fin[other][0]


# ----------------------------------------------------------------------------- rollouts
def _rollout(c=2, v=6, t=3, eos=0, beta=0.8):
    bucket = torch.arange(v) % c
    r = torch.randn(c, v, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    return RolloutProblem("r", _logits((c, v), 3), _logits((c, v), 4), r, beta, bucket, t, eos)


def _rollout_objective(pb, theta):
    """J(θ) by brute-force enumeration of every sequence (independent of the dynamic program)."""
    lq = torch.log_softmax(theta, -1)
    total = theta.new_zeros(())

    def rec(c, logq, logp, rew, depth):
        nonlocal total
        for x in range(lq.shape[1]):
            a, b, r = logq + lq[c, x], logp + pb.log_p[c, x], rew + pb.reward[c, x]
            if depth + 1 == pb.length or x == pb.eos:
                total = total + a.exp() * (r - pb.beta * (a - b))
            else:
                rec(int(pb.bucket[x]), a, b, r, depth + 1)
    rec(0, theta.new_zeros(()), theta.new_zeros(()), theta.new_zeros(()), 0)
    return total


def test_rollout_values_and_true_gradient_match_brute_force():
    pb = _rollout()
    theta = pb.theta0 + 0.3 * _logits(pb.theta0.shape, 7)
    values, grad_j = pb.evaluate(theta)
    th = theta.clone().requires_grad_(True)
    j = _rollout_objective(pb, th)
    (g,) = torch.autograd.grad(j, th)
    assert abs(values["objective"] - float(j.detach())) < 1e-12
    assert torch.allclose(grad_j, g, rtol=0, atol=1e-12)
    assert values["kl_opt"] > 0


def _rollout_follows_autograd(label, steps):
    """seq rows of the correct modes and the per-token score-function sum have E[update] = ∇J: the exact
    trajectory (expected gradients by the counting dynamic program) equals SGD on autograd of J."""
    pb = _rollout()
    combo = parse_combination(label, ("tok", "seq"))
    lr = 0.5
    ours = [th for _, th, _ in trajectory(pb.theta0, Optimizer("sgd", lr), steps,
                                          lambda th, t: pb.expected_update(th, combo))]
    theta = pb.theta0.clone()
    for t in range(steps + 1):
        assert torch.allclose(ours[t], theta, rtol=0, atol=1e-10)
        _, g = pb.evaluate(theta)
        theta = theta + lr * g


@pytest.mark.parametrize("label", ["k1/reward/seq", "k3/loss_is/seq", "k1/reward/tok", "k1/reward+loss/tok",
                                   "k3/reward+loss/tok", "k1/reward_to_go/tok"])
def test_rollout_correct_modes_follow_autograd_of_the_true_objective(label):
    _rollout_follows_autograd(label, 8)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["k1/reward/seq", "k2/loss/seq", "k3/loss_is/seq", "k1/reward/tok",
                                   "k3/reward+loss/tok", "k1/reward_to_go/tok"])
def test_rollout_correct_modes_follow_autograd_over_50_steps(label):
    _rollout_follows_autograd(label, 50)


def test_rollout_k1_in_the_loss_never_moves_the_policy():
    pb = _rollout()
    pb = RolloutProblem(pb.name, pb.theta0, pb.log_p, torch.zeros_like(pb.reward), pb.beta, pb.bucket, pb.length,
                        pb.eos)
    combo = parse_combination("k1/loss/tok", ("tok", "seq"))
    # E[Σ_t s_t] = 0 exactly; the counting dynamic program leaves rounding of ~1e-17 (SGD here: Adam
    # would divide that rounding by its own scale and take steps of ~lr·1e-9).
    run = list(trajectory(pb.theta0, Optimizer("sgd", 1.0), 50, lambda th, t: pb.expected_update(th, combo)))
    assert max(float(g.abs().max()) for _, _, g in run) < 1e-14
    assert max(float((th - pb.theta0).abs().max()) for _, th, _ in run) < 1e-12


# ----------------------------------------------------------------------------- sampled, specs, CLI
def _spec(train: dict, cases=None, draws=400) -> dict:
    cat = {"name": "cat", "kind": "categorical", "vocab": 12, "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
           "p": {"from": "q", "noise": 0.5, "seed": 2}}
    base = {"optimizer": "sgd", "lr": 0.5, "steps": 12, "beta": 0.5, "reward": {"random": 1.0},
            "combinations": ["k1/reward", "k3/loss"]}
    return {"spec_version": 1, "experiment": {"name": "t", "draws": draws, "seed": 3, "device": "cpu"},
            "train": {**base, **train}, "case": cases or [cat]}


def test_sampled_trajectories_scatter_around_the_exact_one():
    """The mean of 24 sampled trajectories at every step, within 5 standard errors (sd/√seeds) of the exact
    trajectory. (Curvature makes E[value(θ_t)] differ from value(E θ_t) by O(lr²·Var/n), far below the SE.)"""
    import kl_bench.api as api
    res = api.train(_spec({"gradients": ["exact", "sampled"], "seeds": 24, "record_every": 3}))
    df = res.frame
    for combo, d in df.groupby("combination"):
        ex = d[d.gradients == "exact"].set_index("step")
        sa = d[d.gradients == "sampled"].set_index("step")
        assert (sa.seeds == 24).all() and (sa.draws == 400).all()
        for m in ("kl_rev", "kl_fwd", "entropy", "objective", "kl_opt"):
            se = sa[f"{m}_sd"].iloc[1:] / math.sqrt(24)
            z = (sa[m].iloc[1:] - ex[m].iloc[1:]) / se
            assert (se > 0).all() and (z.abs() < 5).all(), (combo, m, z.tolist())
            # step 0: every run starts at the initial policy (the mean of 24 equal numbers, up to rounding)
            assert abs(sa[m].iloc[0] - ex[m].iloc[0]) < 1e-12 and sa[f"{m}_sd"].iloc[0] < 1e-12


def test_sampled_bytes_do_not_depend_on_chunk():
    """70,000 draws a step: two pieces (2^16 + rest); chunk only groups them for the search."""
    import kl_bench.api as api
    spec = dict(_spec({"gradients": ["sampled"], "seeds": 2, "steps": 2}, draws=70_000))
    a = api.train({**spec, "train": {**spec["train"], "chunk": 1000}}).files()
    b = api.train({**spec, "train": {**spec["train"], "chunk": 1 << 22}}).files()
    assert a == b


def test_sampled_rollout_matches_the_exact_expectation_at_step_0():
    """One step's sampled update from (seed, case/train/run, 0): its mean over runs is the exact expected update."""
    from kl_bench.sampling.seeding import BatchStream
    pb = _rollout()
    combo = parse_combination("k3/loss/tok", ("tok", "seq"))
    exact = pb.expected_update(pb.theta0, combo)
    runs = torch.stack([pb.sampled_update(pb.theta0, combo, BatchStream(0, f"r/train/{i}", 0, 500, torch.device("cpu")),
                                          1 << 16, 1 << 20) for i in range(40)])
    z = (runs.mean(0) - exact) / (runs.std(0) / math.sqrt(40))
    assert float(z.abs().max()) < 5


TRAIN_TOML = {"optimizer": '"sgd"', "lr": "0.5", "steps": "3", "beta": "0.5", "reward": "{ random = 1.0 }",
              "combinations": '["k1/reward", "k3/loss"]'}
CASE_TOML = """
[[case]]
name = "cat"
kind = "categorical"
vocab = 12
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.5, seed = 2 }
"""

BAD = [
    ({"optimizer": None, "optimiser": '"sgd"'}, "train.optimiser", "did you mean 'optimizer'"),
    ({"optimizer": '"adamw"'}, "train.optimizer", "did you mean 'adam'"),
    ({"lr": "-1.0"}, "train.lr", "must be > 0"),
    ({"steps": '"ten"'}, "train.steps", "must be an integer"),
    ({"combinations": '["k3/los"]'}, "train.combinations", "did you mean 'loss'"),
    ({"combinations": '["k9/loss"]'}, "train.combinations", "unknown estimator"),
    ({"combinations": '["k3/loss/tok"]'}, "train.combinations", "aggregate 'tok' is not available"),
    ({"gradients": '["sampeld"]'}, "train.gradients", "did you mean 'sampled'"),
    ({"reward": "{ randm = 1.0 }"}, "train.reward", "did you mean 'random'"),
    ({"reward": "{ tokens = [99] }"}, "train.reward.tokens", "outside the vocabulary"),
    ({"beta": "0.0"}, "train.beta", "must be > 0"),
    ({"reward": '{ file = "nope.npy" }'}, "train.reward.file", "reward table file not found"),   # not "logits"
]


@pytest.mark.parametrize("bad,key,message", BAD)
def test_bad_train_input_is_one_line_exit_2(tmp_path, bad, key, message):
    from typer.testing import CliRunner

    from kl_bench.cli import app
    table = {k: v for k, v in {**TRAIN_TOML, **bad}.items() if v is not None}
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 10\ndevice = "cpu"\n[train]\n'
            + "".join(f"{k} = {v}\n" for k, v in table.items()) + CASE_TOML)
    path = tmp_path / "s.toml"
    path.write_text(text)
    res = CliRunner().invoke(app, ["train", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    err = res.output.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"key '{key}'" in err and message in err and str(path) in err, err
    assert not (tmp_path / "out").exists()


def test_train_command_writes_csv_and_envelope(tmp_path):
    import json

    from typer.testing import CliRunner

    from kl_bench.cli import app
    from kl_bench.results import read_frame
    from kl_bench.training import TRAIN_SCHEMA
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 10\ndevice = "cpu"\n[train]\n'
            + "".join(f"{k} = {v}\n" for k, v in TRAIN_TOML.items()) + CASE_TOML)
    (tmp_path / "s.toml").write_text(text)
    res = CliRunner().invoke(app, ["train", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "closest to the optimum" in res.output and "k1/reward" in res.output
    df = read_frame(tmp_path / "out" / "train.csv")
    assert list(df.columns) == list(TRAIN_SCHEMA) and len(df) == 2 * 4
    env = json.loads((tmp_path / "out" / "run.json").read_text())
    assert env["kl_bench_train"] == 1 and set(env["files"]) == {"train.csv"}
    # `kl-bench report` on a training folder: the figures and the final values of every combination
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "out"), "--formats", "png,pdf"])
    assert rep.exit_code == 0, rep.output
    md = (tmp_path / "out" / "report" / "report.md").read_text()
    last = df[df["step"] == df["step"].max()]
    for r in last.itertuples():
        assert f"| {r.case} | {r.combination} | {r.gradients} | {r.step} | {r.kl_rev:.4g} |" in md
    assert (tmp_path / "out" / "report" / "figures" / "training_cat.pdf").stat().st_size > 1000


def test_figures_leave_global_state_alone_and_render_every_case(tmp_path):
    import matplotlib

    import kl_bench.api as api
    from kl_bench.present.training_plots import plot_metric, plot_training, render_training_figures
    res = api.train(_spec({"gradients": ["exact", "sampled"], "seeds": 2, "steps": 4}))
    before = dict(matplotlib.rcParams)
    fig = plot_training(res.frame)
    assert len(fig.axes) == 6 and fig.axes[0].get_ylabel() == "KL(q‖p)"
    assert fig.axes[5].get_ylabel().startswith("KL(q‖q*)") and fig.axes[5].get_yscale() == "log"
    assert len(fig.axes[0].lines) == 4            # 2 combinations × (exact line + sampled mean)
    assert plot_metric(res.frame, "kl_opt").axes[0].get_ylabel().startswith("KL(q‖q*)")
    assert dict(matplotlib.rcParams) == before
    res.write(tmp_path / "run")
    paths = render_training_figures(tmp_path / "run", tmp_path / "fig")
    assert [p.name for p in paths] == ["training_cat.png"] and paths[0].stat().st_size > 10_000


def test_a_diverged_trajectory_is_named_not_ranked(tmp_path):
    """An lr that overflows θ (k3 in the loss at lr = 1e308) made empty train.csv cells, numpy's overflow
    warnings on stderr and a summary that still named a winner: the run writes its rows as before (NaN is
    what the trajectory is), names every diverged trajectory in one warning line each with its first
    non-finite step, leaves it out of the ranking, and leaks no numpy warning."""
    import subprocess
    import sys

    from kl_bench.results import read_frame
    from kl_bench.training.result import diverged, summary_lines
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 16\nseed = 0\ndevice = "cpu"\n[train]\n'
            'optimizer = "sgd"\nlr = 1e308\nsteps = 10\nbeta = 0.5\nreward = { random = 1.0 }\n'
            'gradients = ["exact", "sampled"]\nseeds = 2\nrecord_every = 5\n'
            'combinations = ["k2/loss", "k3/loss"]\nsampled_combinations = ["k3/loss"]\n') + CASE_TOML
    (tmp_path / "s.toml").write_text(text)
    proc = subprocess.run([sys.executable, HOOKS, "train", str(tmp_path / "s.toml"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    df = read_frame(tmp_path / "out" / "train.csv")
    gone = diverged(df)
    # θ overflows on the exact trajectory; the sampled one's update stays finite since undrawn tokens no longer
    # make 0·inf (test_k3_in_the_loss_stays_finite_where_r_overflows), so only what is non-finite is named.
    assert [(k, g) for _, k, g, _ in gone] == [("k3/loss", "exact")], gone
    warnings = [x for x in proc.stderr.splitlines() if x.strip()]
    assert warnings == [f"warning: case '{c}': {k} ({g}) diverged: non-finite values from step {s} on (a smaller "
                        "[train] lr?)" for c, k, g, s in gone], proc.stderr
    (line,) = summary_lines(df)
    assert "closest to the optimum" in line and ": k2/loss," in line and "diverged: k3/loss (from step" in line
    assert line in proc.stdout


@pytest.mark.parametrize("beta", [0.8, 0.002])
def test_rollout_kl_to_the_optimum_matches_brute_force_also_where_exp_overflows(beta):
    """KL(q‖q*) = log Z − J/β with Z = E_p[exp(Σ_t reward/β)], against every sequence enumerated (log Z by a
    float64 logsumexp over them). At β = 0.002 a path's Σ reward/β passes 709: Z itself overflows float64
    (kl_opt was NaN from step 0 whatever the lr, and every trajectory then read as diverged); log Z does not."""
    pb = _rollout(beta=beta)
    terms = []

    def rec(c, logp, rew, depth):
        for x in range(pb.log_p.shape[1]):
            b, r = logp + float(pb.log_p[c, x]), rew + float(pb.reward[c, x])
            if depth + 1 == pb.length or x == pb.eos:
                terms.append(b + r / beta)
            else:
                rec(int(pb.bucket[x]), b, r, depth + 1)
    rec(0, 0.0, 0.0, 0)
    log_z = float(torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0))
    assert beta > 0.1 or max(terms) > 709                      # the overflow regime is reached
    values, _ = pb.evaluate(pb.theta0)
    exact = log_z - values["objective"] / beta
    # float64 rounding of terms of size |log Z| and |J|/β: a few ulps of the larger
    assert math.isfinite(values["kl_opt"]) and abs(values["kl_opt"] - exact) <= 1e-12 * max(1.0, abs(log_z)), \
        (values["kl_opt"], exact)


def test_a_non_finite_normaliser_is_not_a_divergence():
    """kl_opt holds log Z, a property of the problem: where it is not finite but the policy's values are,
    no trajectory diverged, and the summary says KL(q‖q*) cannot be computed instead of ranking by NaN."""
    import pandas as pd

    from kl_bench.training.result import diverged, summary_lines
    rows = [dict(case="c", combination=k, gradients="exact", step=s, kl_rev=0.1 * s, kl_fwd=0.2, entropy=1.0,
                 reward=0.5, objective=0.4, kl_opt=math.nan) for k in ("k1/reward", "k3/loss") for s in (0, 5)]
    df = pd.DataFrame(rows)
    assert diverged(df) == []
    (line,) = summary_lines(df)
    assert "not computable" in line and "closest" not in line
    df.loc[(df.combination == "k3/loss") & (df.step == 5), "entropy"] = math.inf
    assert diverged(df) == [("c", "k3/loss", "exact", 5)]


def test_a_rollout_trajectory_that_leaves_float64_is_named_and_the_run_written(tmp_path):
    """k3 of the sequence in the loss at lr = 100 (Adam) takes the rollout policy where the gradient's moments
    E[R^s ...] leave float64: the run stopped with a spec error mid-way (exit 2, nothing written); that
    trajectory now reads as diverged from that step, and every other one is written. (The token row, k3/loss
    on tok, stays finite there: test_k3_in_the_loss_on_tokens_stays_finite_where_r_overflows.)"""
    from typer.testing import CliRunner

    from kl_bench.cli import app
    from kl_bench.results import read_frame
    from kl_bench.training.result import diverged
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 16\nseed = 0\ndevice = "cpu"\n[train]\n'
            'optimizer = "adam"\nlr = 100\nsteps = 20\nbeta = 0.5\nreward = { random = 1.0, penalty = true, seed = 7 }\n'
            'record_every = 5\ncombinations = ["k1/reward", "k3/loss/seq"]\n[[case]]\nname = "rollout"\nkind = "rollout"\n'
            'vocab = 64\nbuckets = 4\nlength = 8\neos = 0\nq = { logits = "zipf", exponent = 1.0, seed = 3 }\n'
            'p = { from = "q", noise = 1.0, seed = 4 }\n')
    (tmp_path / "s.toml").write_text(text)
    res = CliRunner().invoke(app, ["train", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    df = read_frame(tmp_path / "out" / "train.csv")
    assert [(k, g) for _, k, g, _ in diverged(df)] == [("k3/loss/seq", "exact")]
    assert "warning: case 'rollout': k3/loss/seq (exact) diverged" in res.output
    assert df[df.combination == "k1/reward"]["kl_rev"].notna().all()


_TRAIN = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = {draws}\nseed = 0\ndevice = "cpu"\n[train]\n'
          'optimizer = "{opt}"\nlr = 0.05\nsteps = 2\nbeta = 0.5\nreward = {{ random = 1.0 }}\n'
          'gradients = ["exact", "sampled"]\nseeds = 1\n{more}'
          'combinations = {combos}\nsampled_combinations = ["k1/reward"]\n')


@pytest.mark.parametrize("edit, needle", [
    # an unknown estimator or mode is named under train.combinations (it had been blamed on
    # sampled_combinations, whose 'k1/reward' was "unknown" against the misspelt list, the suggestion reversed)
    ({"combos": '["k9/reward"]'}, "key 'train.combinations': unknown estimator 'k9' (did you mean 'k3'?)"),
    ({"combos": '["k1/rewrd"]'}, "key 'train.combinations': 'k1/rewrd': unknown mode 'rewrd' (did you mean 'reward'?)"),
    # 1e15 draws a sampled step ended in an out-of-memory line naming no key, after 10 s
    ({"draws": "1e15"}, "key 'experiment.draws': gives each sampled step of the [train] table 1,000,000,000,000,000"),
    ({"more": "draws = 1e15\n"}, "key 'train.draws': must be ≤ 1,099,511,627,776"),
    # Adam's constants with sgd were ignored in silence
    ({"opt": "sgd", "more": "betas = [0.9, 0.99]\n"}, "key 'train.betas': is one of Adam's constants"),
    ({"opt": "sgd", "more": "eps = 1e-6\n"}, "key 'train.eps': is one of Adam's constants"),
])
def test_train_table_mistakes_are_one_line_naming_their_key(tmp_path, edit, needle):
    from typer.testing import CliRunner

    from kl_bench.cli import app
    fill = {"draws": "16", "opt": "adam", "more": "", "combos": '["k1/reward", "k3/loss"]', **edit}
    (tmp_path / "s.toml").write_text(_TRAIN.format(**fill) + CASE_TOML)
    res = CliRunner().invoke(app, ["train", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
    assert not (tmp_path / "out").exists()


def _train_csv(tmp_path, **train):
    """train.csv of TRAIN_TOML's case with ``train``'s keys replaced (sampled runs of 4 seeds), via the API."""
    import kl_bench
    settings = {**TRAIN_TOML, "gradients": '["exact", "sampled"]', "seeds": "4", **train}
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 64\ndevice = "cpu"\n[train]\n'
            + "".join(f"{k} = {v}\n" for k, v in settings.items()) + CASE_TOML)
    (tmp_path / "s.toml").write_text(text)
    return kl_bench.train(tmp_path / "s.toml").frame


@pytest.mark.parametrize("optimizer", ['"sgd"', '"adam"'])
def test_the_spread_of_values_near_float64s_limit_is_finite(tmp_path, optimizer):
    """[train] beta = 1e-300: KL(q‖q*) is about 1e300, and its sd over seeds was inf (np.std squares the
    deviations: 1e600). Every mean and sd is finite where every value is."""
    df = _train_csv(tmp_path, beta="1e-300", optimizer=optimizer, steps="2")
    sampled = df[df["gradients"] == "sampled"]
    assert (sampled["kl_opt"].abs() > 1e299).all()
    values = sampled[[c for c in df.columns if c.endswith("_sd") or c in ("kl_opt", "grad_norm")]].to_numpy(float)
    assert math.isfinite(values.sum()), sampled.to_string()
    assert (sampled.loc[sampled["step"] > 0, "kl_opt_sd"] > 0).all()


def test_huge_gradients_move_the_policy_and_their_norms_are_finite(tmp_path):
    """[train] beta = 1e200: gradients of about 1e199, whose squares overflow float64. Adam's second moment
    was inf (every step 0: the policy never moved), |g| was inf and cos(g, ∇J) NaN. Adam keeps its second
    moment in units of a power of two: the policy moves as with a moderate beta, by Adam's scale invariance."""
    big = _train_csv(tmp_path, beta="1e200", optimizer='"adam"', lr="0.05", steps="3", reward='"none"')
    small = _train_csv(tmp_path, beta="1.0", optimizer='"adam"', lr="0.05", steps="3", reward='"none"')
    exact_big, exact_small = (d[d["gradients"] == "exact"].reset_index(drop=True) for d in (big, small))
    assert exact_big["kl_rev"].iloc[-1] < exact_big["kl_rev"].iloc[0]
    assert exact_big["kl_rev"].to_numpy() == pytest.approx(exact_small["kl_rev"].to_numpy(), rel=1e-6)
    # Adam's eps (1e-8 next to √v) moves the small-β run by ~1e-7, not the 1e200 one
    assert (exact_big["grad_norm"] / exact_small["grad_norm"]).to_numpy() == pytest.approx(1e200, rel=1e-5)
    assert big["cos_true"].notna().all()
    assert exact_big["cos_true"].to_numpy() == pytest.approx(exact_small["cos_true"].to_numpy(), rel=1e-6)


def test_spread_helpers_are_the_plain_computation_where_nothing_overflows():
    """core.stats.mean_sd and vector_norm: bit for bit np.mean, np.std and Tensor.norm on ordinary values (the
    committed train.csv files do not move), exact scaling by powers of two beyond 2^±500."""
    import numpy as np

    from kl_bench.core.stats import mean_sd, vector_norm
    from kl_bench.training.optim import AdamState, adam
    g = np.random.default_rng(0)
    x = g.standard_normal((4, 7)) * 10.0 ** g.integers(-5, 5, 7)
    m, s = mean_sd(x)
    assert np.array_equal(m, np.mean(x, 0)) and np.array_equal(s, np.std(x, 0, ddof=1))
    m, s = mean_sd(x * 2.0 ** 1000)
    assert np.isfinite(s).all() and np.allclose(s / 2.0 ** 1000, np.std(x, 0, ddof=1), rtol=1e-14, atol=0)
    m, s = mean_sd(x * 2.0 ** -1060)           # subnormal: squares underflow to 0 without the scaling
    assert (s > 0).all()
    t = torch.from_numpy(x.ravel())
    assert vector_norm(t) == float(t.norm()) and vector_norm(t * 2.0 ** 900) == pytest.approx(float(t.norm()) * 2.0 ** 900)
    theta, grad = torch.zeros(5, dtype=torch.float64), torch.from_numpy(x[0, :5])
    zero = AdamState(torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), 0)
    plain, state = adam(theta, grad, zero, 0.1, (0.9, 0.999), 0.0)
    huge, state_big = adam(theta, grad * 2.0 ** 1000, zero, 0.1, (0.9, 0.999), 0.0)
    assert state.scale == 0 and state_big.scale > 0 and torch.equal(plain, huge)
    again, _ = adam(huge, grad * 2.0 ** 1000, state_big, 0.1, (0.9, 0.999), 0.0)
    twice, _ = adam(plain, grad, state, 0.1, (0.9, 0.999), 0.0)
    assert torch.allclose(again, twice, rtol=1e-14, atol=0)


def test_k3_in_the_loss_stays_finite_where_r_overflows():
    """k3 in the loss has the expected update β-weighted q − p plus the reward's: bounded. Where a token's
    log q falls 709 below log p, r = p/q is inf in float64 and q ⊙ (1 − r) formed directly is 0·inf = NaN
    (a trajectory at lr = 100 was called diverged and its rows left empty). The update now equals the closed
    form q ⊙ reward − β(q − p), shifted and projected, within float64 rounding, at ordinary and at extreme θ;
    a sampled update ignores tokens never drawn, however infinite their a."""
    from kl_bench.kinds.categorical.training import count_gradient
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(2, 6, generator=g, dtype=torch.float64), -1)
    reward = torch.randn(2, 6, generator=g, dtype=torch.float64)
    beta = 0.5
    problem = CategoricalProblem("x", lp.clone(), lp, reward, beta)
    combo = parse_combination("k3/loss", ())

    def closed(theta):
        lq = torch.log_softmax(theta, -1)
        q = lq.exp()
        qa = q * reward - beta * (q - lp.exp())
        return (qa - q * qa.sum(-1, keepdim=True) / q.sum(-1, keepdim=True)) / q.shape[0]
    extreme = torch.tensor([[-800.0, 1.0, -800.0, 0.5, -2000.0, 0.0], [0.0, -900.0, 1.0, 2.0, 3.0, 4.0]],
                           dtype=torch.float64)
    for theta in (torch.randn(2, 6, generator=g, dtype=torch.float64), extreme):
        got = problem.expected_update(theta, combo)
        assert torch.isfinite(got).all()
        # float64 rounding of sums of a dozen terms of size ≤ max(|reward|, β) + 1
        assert (got - closed(theta)).abs().max() <= 64 * 2.0**-52 * (reward.abs().max() + beta + 1), (got, closed(theta))
    q = torch.softmax(extreme, -1)
    counts = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 1.0, 1.0, 4.0]], dtype=torch.float64)
    a = problem.reward - beta * combo.item.coef(lp - torch.log_softmax(extreme, -1))
    assert not torch.isfinite(a).all()
    drawn = count_gradient(q, counts, torch.where(counts > 0, a, torch.zeros_like(a)))
    assert torch.equal(count_gradient(q, counts, a), drawn)


def test_a_finite_training_run_is_not_called_diverged(tmp_path):
    """The probe's run at lr = 300: sgd, k3/loss beside k1/reward on a vocabulary of 50; some log q fall
    709 below log p on the way. Every recorded value is finite and no trajectory is said to diverge (three
    were, their rows empty)."""
    import pandas as pd
    from typer.testing import CliRunner
    from kl_bench.cli import app
    spec = tmp_path / "x.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "t"\ndraws = 64\nseed = 0\ndevice = "cpu"\n[train]\n'
                    'optimizer = "sgd"\nlr = 300\nsteps = 200\nbeta = 0.5\ngradients = ["exact", "sampled"]\nseeds = 2\n'
                    'record_every = 50\ncombinations = ["k1/reward", "k3/loss"]\n[[case]]\nname = "v"\n'
                    'kind = "categorical"\nvocab = 50\nq = { logits = "zipf", exponent = 1.1, seed = 1 }\n'
                    'p = { from = "q", noise = 1.0, seed = 2 }\n')
    res = CliRunner().invoke(app, ["train", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0 and "diverged" not in res.output, res.output
    df = pd.read_csv(tmp_path / "o" / "train.csv")
    assert len(df) and df[["kl_rev", "kl_fwd", "kl_opt", "objective", "grad_norm"]].notna().all().all()


def test_one_seed_has_no_spread_and_no_warning(tmp_path):
    """seeds = 1: the sampled rows' sds are NaN (one trajectory has no spread), and numpy's 'degrees of
    freedom <= 0' warning does not reach stderr (core.stats.mean_sd with n ≤ ddof)."""
    import subprocess
    import sys
    import warnings

    import numpy as np
    from kl_bench.core.stats import mean_sd
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m, sd = mean_sd([[1.0, 2.0]], ddof=1)
    assert m.tolist() == [1.0, 2.0] and np.isnan(sd).all()
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "t"\ndraws = 64\nseed = 0\ndevice = "cpu"\n[train]\n'
                    'optimizer = "sgd"\nlr = 1\nsteps = 10\nbeta = 0.5\ngradients = ["exact", "sampled"]\nseeds = 1\n'
                    'record_every = 5\ncombinations = ["k1/reward"]\n' + CASE_TOML)
    res = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "kl_bench", "train", str(spec), "--out",
                          str(tmp_path / "o"), "-q"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr


# ----------------------------------------------------------------------------- 4. train: argument types
TRAIN_SPEC = """spec_version = 1
[experiment]
name = "t"
draws = 10
device = "cpu"
[train]
optimizer = "sgd"
lr = 0.5
steps = 2
beta = 0.5
reward = { random = 1.0 }
combinations = ["k1/reward"]
[[case]]
name = "cat"
kind = "categorical"
vocab = 12
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.5, seed = 2 }
"""


@pytest.mark.parametrize("argument, value", [("ranks", (0, 2)), ("ranks", 5), ("ranks", "0"), ("progress", "yes"),
                                             ("progress", 2), ("console", 3)])
def test_train_refuses_an_argument_of_the_wrong_type_naming_it(tmp_path, argument, value):
    """ranks=(0, 2) had been AttributeError: 'tuple' object has no attribute 'rank' from the training loop."""
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    with pytest.raises(SpecError) as e:
        kl_bench.train(spec, **{argument: value})
    assert str(e.value).startswith(f"key '{argument}': must be") and "\n" not in str(e.value)


def test_train_takes_its_arguments_of_the_right_type(tmp_path):
    from rich.console import Console

    from kl_bench.engine.distributed import Ranks
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    got = kl_bench.train(spec, ranks=Ranks(), progress=False, console=Console(stderr=True))
    assert got is not None and len(got.frame) > 0
