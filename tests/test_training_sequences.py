"""A per-sequence reward R(y) in training (kl_bench.training.sequences): exact values, ∇J and trajectories
against an independent enumeration (a recursion over tuples) with autograd, the optimum q* reached, the
additive reward |y| against the dynamic program's per-token table, sampled means within 5 SE of the exact
ones, bad plug-ins and oversized cases as one line (exit 2), and `kl-bench train` refusing torchrun."""
import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kl_bench.sampling.seeding import BatchStream
from kl_bench.kinds.rollout.training import RolloutProblem, SequenceRolloutProblem
from kl_bench.training import SEQUENCE_REWARDS, Optimizer, parse_combination, run_trajectory, trajectory
from kl_bench.kinds.rollout.sequences import count_sequences, enumerate_sequences
from kl_bench.training.sequences import rewards_of

from .helpers import HOOKS

ROOT = Path(__file__).resolve().parents[1]
AGG = ("tok", "seq")
STEPS = 50


def _logits(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, dtype=torch.float64, generator=g), -1)


def _problem(name="distinct", c=2, v=4, t=3, eos=0, beta=0.8) -> SequenceRolloutProblem:
    bucket = torch.arange(v) % c
    seqs = enumerate_sequences(bucket, v, t, eos)
    fn = SEQUENCE_REWARDS[name]
    return SequenceRolloutProblem("r", _logits((c, v), 3), _logits((c, v), 4), torch.zeros(c, v, dtype=torch.float64),
                                  beta, bucket, t, eos, functools.partial(rewards_of, fn), seqs,
                                  rewards_of(fn, seqs.tokens, seqs.mask))


def _brute_sequences(pb):
    """Every sequence as (tokens, bucket of each step), by recursion over tuples: independent of
    enumerate_sequences' vectorised level-by-level construction."""
    out = []

    def rec(prefix, ctxs, c):
        for x in range(pb.log_p.shape[1]):
            y, cs = prefix + (x,), ctxs + (c,)
            if len(y) == pb.length or x == pb.eos:
                out.append((y, cs))
            else:
                rec(y, cs, int(pb.bucket[x]))
    rec((), (), 0)
    return out


def _counts(pb, seqs):
    """N [M, C·V]: how often each sequence draws token x in bucket c (log q(y) = N · log q, flattened)."""
    n = torch.zeros(len(seqs), pb.log_p.numel(), dtype=torch.float64)
    for i, (y, cs) in enumerate(seqs):
        for x, c in zip(y, cs):
            n[i, c * pb.log_p.shape[1] + x] += 1
    return n


def _brute(pb, reward=None):
    """(N, R) of the recursion's sequences, R(y) = reward(tuple) (default: distinct ids, len(set(y)))."""
    seqs = _brute_sequences(pb)
    return _counts(pb, seqs), torch.tensor([(reward or _distinct)(y) for y, _ in seqs], dtype=torch.float64)


def _brute_objective(pb, theta, brute):
    """J(θ) = Σ_y q(y)(R(y) − β log(q(y)/p(y))) over the recursion's sequences, differentiable in θ."""
    n, r = brute
    lq_y = n @ torch.log_softmax(theta, -1).reshape(-1)
    lp_y = n @ pb.log_p.reshape(-1)
    return (lq_y.exp() * (r - pb.beta * (lq_y - lp_y))).sum()


def _distinct(y):
    return float(len(set(y)))


def test_sequences_are_counted_and_enumerated_once_each():
    for v, t, eos in [(4, 3, 0), (3, 4, None), (5, 1, 2), (2, 6, 1)]:
        pb = _problem(c=2, v=v, t=t, eos=eos)
        brute = sorted(y for y, _ in _brute_sequences(pb))
        ours = sorted(tuple(int(x) for x in row[m]) for row, m in zip(pb.seqs.tokens, pb.seqs.mask))
        assert ours == brute and len(brute) == count_sequences(v, t, eos)


def test_values_and_true_gradient_match_brute_force_enumeration():
    pb = _problem()
    theta = pb.theta0 + 0.3 * _logits(pb.theta0.shape, 7)
    values, grad_j = pb.evaluate(theta)
    seqs = _brute_sequences(pb)
    th = theta.clone().requires_grad_(True)
    j = _brute_objective(pb, th, _brute(pb))
    (g,) = torch.autograd.grad(j, th)
    j = j.detach()
    assert abs(values["objective"] - float(j)) < 1e-12
    assert torch.allclose(grad_j, g, rtol=0, atol=1e-12)
    lq = torch.log_softmax(theta, -1)
    lq_y = torch.stack([sum(lq[c, x] for x, c in zip(y, cs)) for y, cs in seqs])
    lp_y = torch.stack([sum(pb.log_p[c, x] for x, c in zip(y, cs)) for y, cs in seqs])
    r = torch.tensor([_distinct(y) for y, _ in seqs], dtype=torch.float64)
    q = lq_y.exp()
    assert abs(float(q.sum()) - 1) < 1e-14 and abs(float(lp_y.exp().sum()) - 1) < 1e-14
    assert abs(values["reward"] - float((q * r).sum())) < 1e-12
    assert abs(values["kl_rev"] - float((q * (lq_y - lp_y)).sum())) < 1e-12
    assert abs(values["kl_fwd"] - float((lp_y.exp() * (lp_y - lq_y)).sum())) < 1e-12
    assert abs(values["entropy"] + float((q * lq_y).sum())) < 1e-12
    # KL(q‖q*) = log Z − J/β, Z = Σ_y p(y) exp(R(y)/β): the identity, against the direct sum reported
    log_z = float(torch.logsumexp(lp_y + r / pb.beta, 0))
    assert values["kl_opt"] > 0.01 and abs(values["kl_opt"] - (log_z - float(j) / pb.beta)) < 1e-12


def _torch_adam(pb, brute, lr, steps):
    th = torch.nn.Parameter(pb.theta0.clone())
    opt = torch.optim.Adam([th], lr=lr, maximize=True)
    out = []
    for _ in range(steps + 1):
        out.append(th.detach().clone())
        opt.zero_grad()
        _brute_objective(pb, th, brute).backward()
        opt.step()
    return out


@pytest.mark.parametrize("label, optimizer", [("k1/reward/seq", "sgd"), ("k1/reward/tok", "sgd"),
                                              ("k2/loss/seq", "adam")])
def test_trajectories_follow_autograd_of_the_enumerated_objective(label, optimizer):
    """These combinations' expected updates equal ∇J (the reward's score function by enumeration, the KL
    term by the counting dynamic program): 50 steps against SGD / torch.optim.Adam on autograd of J."""
    pb = _problem()
    brute = _brute(pb)
    combo = parse_combination(label, AGG)
    lr = 0.5 if optimizer == "sgd" else 0.05
    ours = [th for _, th, _ in trajectory(pb.theta0, Optimizer(optimizer, lr), STEPS,
                                          lambda th, t: pb.expected_update(th, combo))]
    if optimizer == "adam":
        ref = _torch_adam(pb, brute, lr, STEPS)
    else:
        ref, theta = [], pb.theta0.clone()
        for _ in range(STEPS + 1):
            ref.append(theta)
            th = theta.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(_brute_objective(pb, th, brute), th)
            theta = theta + lr * g
    assert len(ours) == STEPS + 1
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert float((ours[-1] - ours[0]).abs().max()) > 0.1


def test_one_step_rollouts_reach_the_optimum():
    """T = 1: q*(x) ∝ p(x)·exp(R([x])/β) is a per-bucket policy, so ∇J's trajectory reaches it."""
    pb = _problem("distinct", c=1, v=5, t=1, eos=None, beta=1.0)
    log_p = torch.log_softmax(0.5 * pb.log_p, -1)          # no token below 5% under p: SGD converges fast
    pb = SequenceRolloutProblem(pb.name, pb.theta0, log_p, pb.reward, pb.beta, pb.bucket, 1, None, pb.sequence,
                                pb.seqs, torch.tensor([0.3, -1.0, 2.0, 0.0, 0.5], dtype=torch.float64))
    combo = parse_combination("k1/reward/seq", AGG)
    tr = run_trajectory(pb, Optimizer("sgd", 5.0), 250, 250, lambda th, t: pb.expected_update(th, combo))
    assert tr["kl_opt"][0] > 0.1 and tr["kl_opt"][-1] < 1e-12
    log_z = float(torch.logsumexp(pb.log_p[0] + pb.values / pb.beta, 0))
    assert abs(tr["objective"][-1] - pb.beta * log_z) < 1e-12


def test_the_length_reward_is_the_per_token_table_of_ones():
    """|y| is additive: the enumeration and the dynamic program (a table of ones) give one trajectory."""
    seq = _problem("length", c=2, v=5, t=3, eos=0)
    table = RolloutProblem("r", seq.theta0, seq.log_p, torch.ones_like(seq.log_p), seq.beta, seq.bucket, 3, 0)
    combo = parse_combination("k3/loss/tok", AGG)
    runs = [run_trajectory(pb, Optimizer("adam", 0.05), STEPS, 10, lambda th, t, pb=pb: pb.expected_update(th, combo))
            for pb in (seq, table)]
    for k in runs[0]:
        scale = max(1.0, float(abs(runs[1][k]).max()))
        assert abs(runs[0][k] - runs[1][k]).max() < 1e-12 * scale, k
    batch = BatchStream(0, "r/train/0", 0, 300, torch.device("cpu"))
    assert torch.equal(seq.sampled_update(seq.theta0, combo, batch, 1 << 16, 1 << 20),
                       table.sampled_update(seq.theta0, combo, batch, 1 << 16, 1 << 20))


def test_sampled_update_is_unbiased_at_step_0():
    pb = _problem()
    combo = parse_combination("k3/loss/tok", AGG)
    exact = pb.expected_update(pb.theta0, combo)
    runs = torch.stack([pb.sampled_update(pb.theta0, combo, BatchStream(0, f"r/train/{i}", 0, 500, torch.device("cpu")),
                                          1 << 16, 1 << 20) for i in range(40)])
    z = (runs.mean(0) - exact) / (runs.std(0) / math.sqrt(40))
    assert float(z.abs().max()) < 5, z


ROLLOUT = {"name": "roll", "kind": "rollout", "vocab": 4, "buckets": 2, "length": 3, "eos": 0, "bucket_of": "mod",
           "q": {"logits": "zipf", "exponent": 1.0, "seed": 3}, "p": {"from": "q", "noise": 1.0, "seed": 4}}


def test_sampled_trajectories_scatter_around_the_exact_one():
    """The mean of 16 sampled trajectories, within 5 standard errors (sd/√16) of the exact one at every step."""
    import kl_bench.api as api
    seeds = 16
    spec = {"spec_version": 1, "experiment": {"name": "t", "draws": 300, "seed": 5, "device": "cpu"},
            "train": {"optimizer": "sgd", "lr": 0.3, "steps": 6, "beta": 0.5, "reward": {"sequence": "distinct"},
                      "gradients": ["exact", "sampled"], "seeds": seeds, "combinations": ["k1/reward/seq", "k3/loss"]},
            "case": [ROLLOUT]}
    df = api.train(spec).frame
    for combo, d in df.groupby("combination"):
        ex = d[d.gradients == "exact"].set_index("step")
        sa = d[d.gradients == "sampled"].set_index("step")
        assert ex.reward.iloc[-1] != ex.reward.iloc[0]          # the reward moved the policy
        for m in ("kl_rev", "reward", "objective", "kl_opt"):
            se = sa[f"{m}_sd"].iloc[1:] / math.sqrt(seeds)
            z = (sa[m].iloc[1:] - ex[m].iloc[1:]) / se
            assert (se > 0).all() and (z.abs() < 5).all(), (combo, m, z.tolist())


# ----------------------------------------------------------------------------- specs, plug-ins, CLI
PLUGIN = '''
import torch

def good(tokens, mask):
    return (tokens == 1).sum(-1).double() - 0.5 * mask.sum(-1)

def wrong_shape(tokens, mask):
    return torch.zeros(tokens.shape[0], 2)

def nan(tokens, mask):
    out = torch.zeros(tokens.shape[0])
    out[-1] = float("nan")
    return out

def boom(tokens, mask):
    raise ValueError("no reward today")

def words(tokens, mask):
    return "high"

NOT_A_FUNCTION = 3

CALLS = [0]

def fails_after_planning(tokens, mask):
    CALLS[0] += 1
    if CALLS[0] > 1:
        raise RuntimeError("called again")
    return mask.sum(-1).double()
'''

CASES = {
    "roll": ROLLOUT,
    "big": {**ROLLOUT, "name": "big", "vocab": 64, "length": 8},
    "cat": {"name": "cat", "kind": "categorical", "vocab": 6, "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
            "p": {"from": "q", "noise": 0.5, "seed": 2}},
}


def _toml_value(v):
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return f'"{v}"' if isinstance(v, str) else str(v)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One folder for every spec: the plug-in module beside them is imported once (Python caches it by name)."""
    tmp = tmp_path_factory.mktemp("seqreward")
    (tmp / "kltest_seqrewards.py").write_text(PLUGIN)
    return tmp


def _cli(folder, name, reward, case="roll", gradients='["exact"]'):
    from typer.testing import CliRunner

    from kl_bench.cli import app
    body = "\n".join(f"{k} = {_toml_value(v)}" for k, v in CASES[case].items())
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 50\ndevice = "cpu"\n[train]\noptimizer = "sgd"\n'
            f'lr = 0.5\nsteps = 2\nbeta = 0.5\ngradients = {gradients}\nseeds = 2\n'
            f'combinations = ["k1/reward"]\nreward = {{ sequence = "{reward}" }}\n[[case]]\n{body}\n')
    path = folder / f"{name}.toml"
    path.write_text(text)
    out = folder / f"out-{name}"
    return CliRunner().invoke(app, ["train", str(path), "--out", str(out)]), path, out


BAD = [
    ("lenght", "roll", "did you mean 'length'"),
    ("kltest_seqrewards:missing", "roll", "has no attribute 'missing'"),
    ("kltest_seqrewards:NOT_A_FUNCTION", "roll", "is a int, not a function"),
    ("kltest_seqrewards:wrong_shape", "roll", "returned shape [40, 2] for 40 sequences"),
    ("kltest_seqrewards:nan", "roll", "returned nan for the sequence [3, 3, 3]: rewards must be finite"),
    ("kltest_seqrewards:boom", "roll", "raised ValueError: no reward today"),
    ("kltest_seqrewards:words", "roll", "returned a str, not 40 numbers"),
    ("kltest_seqrewards:wrong_shape", "cat", "returned shape [6, 2] for 6 sequences"),
    ("length", "big", "this case has 252,158,292,852,481 (V = 64, T = 8, with EOS): sequences × T must be ≤ 2^22"),
]


@pytest.mark.parametrize("reward, case, message", BAD)
def test_bad_sequence_reward_is_one_line_exit_2(folder, reward, case, message):
    res, path, out = _cli(folder, f"bad{BAD.index((reward, case, message))}", reward, case)
    assert res.exit_code == 2, res.output
    err = res.output.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert message in err and str(path) in err and "key 'train.reward.sequence'" in err, err
    assert ("case '" in err) == (BAD.index((reward, case, message)) > 2), err       # lookups fail before any case
    assert not out.exists()


def test_a_reward_failing_on_a_sampled_path_is_one_line(folder):
    """The enumeration's call succeeds; the first sampled step's call raises: one line naming the file, the
    case and the key, exit 2, nothing written."""
    res, path, out = _cli(folder, "sampled-fail", "kltest_seqrewards:fails_after_planning", "roll", '["sampled"]')
    assert res.exit_code == 2, res.output
    err = res.output.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert (f"{path}: case 'roll': key 'train.reward.sequence': sequence reward 'kltest_seqrewards:fails_after_planning'"
            " raised RuntimeError: called again") in err, err
    assert not out.exists()


def test_a_plug_in_beside_the_spec_trains_rollouts_and_categoricals(folder):
    """Exact and sampled, on a rollout (R on every sequence, then on the sampled paths) and on a categorical
    (R([x]): the reward table)."""
    from kl_bench.results import read_frame
    for case in ("roll", "cat"):
        res, _, out = _cli(folder, f"good-{case}", "kltest_seqrewards:good", case, '["exact", "sampled"]')
        assert res.exit_code == 0, res.output
        df = read_frame(out / "train.csv")
        assert set(df.gradients) == {"exact", "sampled"} and (df.reward != 0).all()
    import kl_bench.api as api
    from kl_bench.training import parse_train, plan_case
    from kl_bench.kinds import build_pair
    sp = api.load(folder / "good-cat.toml")
    cfg = parse_train(sp.train, str(sp.path), sp.path.parent)
    plan = plan_case(sp.cases[0], build_pair(sp.cases[0], str(sp.path)), cfg, 0)
    x = torch.arange(6, dtype=torch.float64)
    assert torch.equal(plan.problem.reward[0], (x == 1).double() - 0.5)


def test_list_names_the_sequence_rewards():
    from typer.testing import CliRunner

    from kl_bench.cli import app
    res = CliRunner().invoke(app, ["list"])
    assert res.exit_code == 0, res.output
    lines = [line.split()[:2] for line in res.output.splitlines()]
    assert all(["reward", name] in lines for name in SEQUENCE_REWARDS.names())


# ----------------------------------------------------------------------------- one process
def _clean_env(monkeypatch, **env):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_the_python_api_under_torchrun_is_refused_in_one_line(folder, monkeypatch):
    """kl_bench.train() without ranks under a torchrun environment: one line (each process would train
    everything); `kl-bench train` splits the work instead (below)."""
    import kl_bench
    from kl_bench.foundation.errors import SpecError
    _, path, _ = _cli(folder, "api", "length")
    _clean_env(monkeypatch, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    with pytest.raises(SpecError) as e:
        kl_bench.train(path)
    assert "\n" not in str(e.value) and "not split across torchrun's 2 processes" in str(e.value)


@pytest.mark.slow
def test_two_gloo_processes_write_the_bytes_of_one(folder, tmp_path):
    """torchrun with 2 CPU processes: the exact trajectories and the sampled runs split across the ranks,
    rank 0 writes train.csv byte for byte as one process does, and says so once."""
    res1, path, out1 = _cli(folder, "torchrun-real", "length", gradients='["exact", "sampled"]')
    assert res1.exit_code == 0, res1.output
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          HOOKS, "train", str(path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "out" / "train.csv").read_bytes() == (out1 / "train.csv").read_bytes()
    assert res.stdout.count("train.csv") == 1
