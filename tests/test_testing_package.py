"""kl_bench.testing as a package other projects import (issue 45 items 3 and 4): light to import, goldens that
regenerate exactly, an opt-in pytest plugin, and a minimum Python version that is true."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kl_bench.testing import goldens, value_grid

pytestmark = pytest.mark.testing
ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("pandas", "scipy", "matplotlib", "seaborn", "typer", "rich")


def test_import_loads_torch_and_nothing_heavy():
    code = ("import sys, kl_bench.testing, kl_bench.testing.plugin; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r}), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True"], out.stdout


def test_it_imports_and_checks_without_numpy():
    """torch alone: numpy blocked (as where torch was installed without it), the import and a whole check work."""
    code = ("import sys, warnings; sys.modules['numpy'] = None; warnings.simplefilter('ignore')\n"
            "import torch\nfrom kl_bench.testing import assert_kl_function\n"
            "assert_kl_function(lambda lp, ref: torch.expm1(ref - lp) - (ref - lp), 'k3', placement='loss_is')\n"
            "print('numpy' in sys.modules and sys.modules['numpy'] is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], out.stdout


def test_the_lightness_check_can_fail():
    """The same subprocess sees a heavy module when one is imported (pandas is installed with kl-bench's base)."""
    pytest.importorskip("pandas")
    code = f"import sys, pandas; print(sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r})[:1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['pandas']", out.stdout


def test_the_goldens_regenerate_exactly():
    """The shipped file is what build() makes now, text for text: a change to a case or a formula that is not
    followed by `python -m kl_bench.testing.goldens` fails here."""
    shipped = goldens.PATH.read_text(encoding="utf-8")
    assert goldens.dumps(goldens.build()) == shipped
    assert json.loads(shipped) == goldens.build()          # floats read back to the same float64


def test_the_goldens_agree_with_the_exact_identities():
    data = goldens.load()
    assert data["format"] == goldens.FORMAT
    for case in data["cases"]:
        e, kl = case["expectations"], case["kl"]
        for name, target in (("k1", "KL(q||p)"), ("k3", "KL(q||p)"), ("fwd_k1", "KL(p||q)"), ("fwd_k3", "KL(p||q)")):
            assert abs(e[name] - kl[target]) <= 1e-13 * max(1.0, kl[target]) * len(case["logprobs"]), (case["name"], name)
    lq, lp = value_grid()           # the goldens' plain-Python grid is the one the check evaluates
    assert data["grid"]["logprobs"] == lq.tolist() and data["grid"]["ref_logprobs"] == lp.tolist()
    stale = dict(data, grid=dict(data["grid"], logprobs=data["grid"]["logprobs"][:-1]))
    assert stale != goldens.build()


PLUGIN_TEST = textwrap.dedent("""
    import torch

    def test_uses_the_fixtures(kl_case, kl_goldens, assert_kl):
        names = [c["name"] for c in kl_goldens["cases"]]
        assert kl_case.name in names
        assert_kl(lambda lq, lp: torch.expm1(lp - lq) - (lp - lq), "k3")
""")


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_user.py").write_text(PLUGIN_TEST)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--rootdir", str(tmp_path), *args, str(tmp_path / "test_user.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_plugin_loads_with_p_and_gives_the_exact_cases(tmp_path):
    out = _pytest(tmp_path, "-p", "kl_bench.testing.plugin")
    assert out.returncode == 0 and "5 passed" in out.stdout, out.stdout + out.stderr


def test_the_plugin_is_not_auto_loaded(tmp_path):
    out = _pytest(tmp_path)
    assert out.returncode != 0 and "fixture 'kl_case' not found" in out.stdout, out.stdout
    from importlib.metadata import entry_points
    assert not [ep for ep in entry_points(group="pytest11") if ep.value.startswith("kl_bench")]


def test_the_package_runs_on_python_3_10_by_its_syntax_and_modules():
    """requires-python says >=3.10: vermin finds no 3.11-only module, function or syntax in the whole package
    (tomllib falls back to tomli). CI also runs this file and tests/test_testing.py on Python 3.10 (.ci/run)."""
    vermin = pytest.importorskip("vermin")
    out = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips", "--violations",
                          "-t=3.10-", str(ROOT / "kl_bench")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert vermin is not None and 'requires-python = ">=3.10"' in (ROOT / "pyproject.toml").read_text()
