"""An opt-in pytest plugin with the exact cases as fixtures: ``pytest -p kl_bench.testing.plugin`` (or
``pytest_plugins = ["kl_bench.testing.plugin"]`` in a conftest.py). kl-bench registers no pytest11 entry
point, so installing kl-bench loads nothing into anyone's test session.

Fixtures:
- ``kl_case``: each exact categorical in turn (kl_bench.testing.Categorical; parametrised by name);
- ``kl_goldens``: the shipped JSON goldens as a dict (kl_bench.testing.goldens);
- ``assert_kl``: :func:`kl_bench.testing.assert_kl_function`.
"""
from __future__ import annotations

import pytest

from . import assert_kl_function, load_goldens
from .cases import CASES


@pytest.fixture(params=CASES, ids=lambda c: c.name)
def kl_case(request):
    """One exact categorical: q = softmax(logits_q), p = softmax(logits_p), every token enumerated."""
    return request.param


@pytest.fixture(scope="session")
def kl_goldens() -> dict:
    return load_goldens()


@pytest.fixture
def assert_kl():
    return assert_kl_function
