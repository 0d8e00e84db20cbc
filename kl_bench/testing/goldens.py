"""The exact cases as JSON goldens (kl_bench/testing/data/kl_cases.json), for libraries whose tests
compare with stored numbers (NeMo-RL's golden tests) rather than import kl-bench at test time.

Every number is computed here in plain Python floats (math.exp, math.expm1, math.log, math.fsum), not with
torch, so the file does not depend on the CPU's vector kernels; json writes floats as repr, which reads
back to the same float64. ``python -m kl_bench.testing.goldens`` rewrites the file; the tests regenerate
it in memory and compare, so a stale golden fails.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .cases import CASES, GRID_HEIGHTS, GRID_LOGR, Categorical

PATH = Path(__file__).with_name("data") / "kl_cases.json"
FORMAT = "kl-bench-goldens/1"

# The formulas in float64 (ℓ = log r = ref_logprobs − logprobs); expm1 keeps r − 1 exact near ℓ = 0.
FORMULAS = {
    "k1": lambda x: -x,
    "k2": lambda x: 0.5 * x * x,
    "k3": lambda x: math.expm1(x) - x,
    "abs": abs,
    "fwd_k1": lambda x: math.exp(x) * x,
    "fwd_k3": lambda x: math.exp(x) * x - math.expm1(x),
}
# Which gradient each (estimator, placement) follows on the gradient cases (docs/gradients.md's table,
# which tests/test_testing.py reproduces from the exact expected gradients).
FOLLOWS = {
    "k1": {"loss": "0", "reward": "KL(q||p)", "loss_is": "KL(q||p)"},
    "k2": {"loss": "KL(q||p)", "reward": "neither", "loss_is": "neither"},
    "k3": {"loss": "KL(p||q)", "reward": "KL(q||p) - KL(p||q)", "loss_is": "KL(q||p)"},
}


def _log_softmax(z: tuple[float, ...]) -> list[float]:
    m = max(z)
    lse = m + math.log(math.fsum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def _grid() -> dict:
    logr = sorted({s * x for x in GRID_LOGR for s in (-1.0, 1.0)})
    lq = [h - max(x, 0.0) for h in GRID_HEIGHTS for x in logr]
    lp = [h + min(x, 0.0) for h in GRID_HEIGHTS for x in logr]
    return {"logprobs": lq, "ref_logprobs": lp,
            "values": {name: [f(b - a) for a, b in zip(lq, lp)] for name, f in FORMULAS.items()}}


def _case(c: Categorical) -> dict:
    lq, lp = _log_softmax(c.logits_q), _log_softmax(c.logits_p)
    q, p = [math.exp(x) for x in lq], [math.exp(x) for x in lp]
    rev = math.fsum(a * (x - y) for a, x, y in zip(q, lq, lp))
    fwd = math.fsum(b * (y - x) for b, x, y in zip(p, lq, lp))
    out = {"name": c.name, "what": c.what, "logits": list(c.logits_q), "logprobs": lq, "ref_logprobs": lp,
           "kl": {"KL(q||p)": rev, "KL(p||q)": fwd},
           "expectations": {name: math.fsum(a * f(y - x) for a, x, y in zip(q, lq, lp)) for name, f in FORMULAS.items()}}
    if c.gradients:
        out["grad_logits"] = {"KL(q||p)": [a * (x - y - rev) for a, x, y in zip(q, lq, lp)],
                              "KL(p||q)": [a - b for a, b in zip(q, p)]}
        out["gradient_follows"] = FOLLOWS
    return out


def build() -> dict:
    """The goldens as a dict (the JSON file's content)."""
    return {
        "format": FORMAT,
        "notation": "logprobs = log q (the policy that samples), ref_logprobs = log p; log r = ref_logprobs - logprobs; "
                    "k1 = -log r, k2 = (log r)^2/2, k3 = (r - 1) - log r, fwd_k1 = r log r, fwd_k3 = r log r - (r - 1)",
        "grid": _grid(),
        "cases": [_case(c) for c in CASES],
        "keys": {"grid.values": "the formula at each (logprobs, ref_logprobs) pair, float64",
                 "cases[].expectations": "E_q[f] = sum_x q(x) f(x), float64 (k1, k3: = KL(q||p); fwd_k1, fwd_k3: = KL(p||q))",
                 "cases[].grad_logits": "exact gradients of KL(q||p) and KL(p||q) with respect to q's logits",
                 "cases[].gradient_follows": "which gradient the expected gradient follows, per estimator and "
                                             "placement (loss: sample held fixed; reward: score function; loss_is: "
                                             "times q/sg(q))"},
    }


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def load() -> dict:
    """The shipped goldens."""
    return json.loads(PATH.read_text(encoding="utf-8"))


if __name__ == "__main__":
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(dumps(build()), encoding="utf-8")
    print(f"wrote {PATH}")
