"""The test configuration itself: robust to the plugins a machine has installed (a GPU box's image ships
pytest-benchmark, which warns under xdist at configuration), strict inside tests, and the file lists of
tests/conftest.py naming files that exist."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from . import conftest

ROOT = Path(__file__).resolve().parents[1]

# A plugin that warns while pytest configures itself, in both ways plugins do it (pytest-benchmark's
# "benchmarks are automatically disabled" under xdist is the first kind).
WARNING_PLUGIN = '''
import warnings
import pytest


class PluginWarning(pytest.PytestWarning):
    pass


def pytest_configure(config):
    warnings.warn(PluginWarning("a plugin's warning at configuration"))
    config.issue_config_time_warning(PluginWarning("a plugin's config-time warning"), stacklevel=2)
'''


def test_a_warning_inside_a_test_is_an_error():
    with pytest.raises(UserWarning):
        warnings.warn("inside a test", UserWarning)


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["serial", "xdist"])   # one worker: the xdist path at one import
def test_a_plugin_warning_at_configuration_does_not_stop_the_run(tmp_path, workers):
    (tmp_path / "warning_plugin.py").write_text(WARNING_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "warning_plugin", "-p", "no:cacheprovider",
                          *workers, "tests/test_config.py::test_a_warning_inside_a_test_is_an_error"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "1 passed" in res.stdout


@pytest.mark.parametrize("name", ["EXTRAS_FILES", "NUMERICS_FILES", "HEAVY_FIRST"])
def test_the_file_lists_name_test_files_that_exist(name):
    missing = [f for f in getattr(conftest, name) if not (ROOT / "tests" / f).is_file()]
    assert not missing, f"{name} names files that do not exist: {missing}"
