import os
import textwrap
from pathlib import Path

import pytest
import torch

from kl_bench.engine.monte_carlo import run_case
from kl_bench.results import to_frame
from kl_bench.experiment.rows import summarize

CPU = torch.device("cpu")

# One intra-op thread in each pytest-xdist worker, and in the processes its tests start. `-n auto` starts a
# worker per core already: a second OpenMP thread per worker only competes for the same cores, and its threads
# spin while they wait (on 2 cores, 1 thread instead of 2 took a test run from 98 s to 63 s of user CPU and
# from 54 s to 42 s of wall time). Bytes never depend on it: every API entry point computes on one thread
# (kl_bench.foundation.threads), and tests/test_distributed.py sets the thread count of the processes it
# compares itself. A run without xdist keeps torch's own count.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def toml_value(v) -> str:
    """A Python value as TOML (strings, numbers, booleans, lists, inline tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return "[" + ", ".join(toml_value(x) for x in v) + "]"


def spec_toml(experiment: dict, cases: list[dict]) -> str:
    """Spec text from an [experiment] table and [[case]] tables (spec_version 1)."""
    lines = ["spec_version = 1", "[experiment]", *(f"{k} = {toml_value(v)}" for k, v in experiment.items())]
    for case in cases:
        lines += ["[[case]]", *(f"{k} = {toml_value(v)}" for k, v in case.items())]
    return "\n".join(lines) + "\n"


GAUSS = {"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 1.0, "std": 1.0}}
CATEGORICAL = {"name": "c", "kind": "categorical", "vocab": 200, "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
               "p": {"from": "q", "noise": 0.4, "seed": 2}}


@pytest.fixture
def build_spec():
    """Spec text from keyword arguments: ``build_spec(cases=[...], name=..., draws=..., ...)``; the
    experiment defaults to a small CPU run of k1 and k3 on :data:`GAUSS` and :data:`CATEGORICAL`."""
    def build(cases: list[dict] | None = None, **experiment) -> str:
        exp = {"name": "test", "draws": 20_000, "seed": 0, "device": "cpu", "batches": 50,
               "estimators": ["k1", "k3"], **experiment}
        return spec_toml(exp, [GAUSS, CATEGORICAL] if cases is None else cases)
    return build


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a spec file from (dedented) text; returns its path."""
    def write(text: str, name: str = "spec.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write


def mc_frame(pair, estimators, draws=200_000, seed=0, batches=100, chunk=1 << 20):
    """Run one pair on the CPU and return its summary rows as a DataFrame."""
    return to_frame(summarize(run_case(pair, list(estimators), draws=draws, seed=seed, batches=batches,
                                       chunk=chunk, device=CPU)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Two tiny random GPT-2 models (policy, perturbed reference), a trained tokenizer and prompts, built
    once per session in a temporary folder (no download); skips without the hf extra."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from kl_bench.kinds.model.tiny import build_tiny_models
    return build_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def one_thread():
    """Model forwards on one thread: tiny models on a shared 2-core machine are 50× slower on two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def model_case(models, name: str = "m", **keys) -> dict:
    """A `kind = "model"` case dict on the tiny models (absolute paths)."""
    return {"name": name, "kind": "model", "policy": str(models / "policy"), "reference": str(models / "reference"),
            "prompts": str(models / "prompts.txt"), **keys}


@pytest.fixture(autouse=True)
def png_figures_only(monkeypatch):
    """Reports in tests draw their figures as PNG only (PDF and SVG triple the drawing time);
    tests/test_report.py::test_figures_are_also_written_as_deterministic_vectors checks the vectors."""
    from kl_bench.present import report_figures
    monkeypatch.setattr(report_figures, "FIGURE_FORMATS", ("png",))


def unrendered_bytes(fig, formats=None) -> dict[str, bytes]:
    """report_figures.figure_bytes without the rendering: the figure closed, empty bytes in each format."""
    import matplotlib.pyplot as plt
    from kl_bench.present import report_figures
    plt.close(fig)
    return {fmt: b"" for fmt in (formats or report_figures.FIGURE_FORMATS)}


@pytest.fixture
def unrendered_figures(monkeypatch):
    """Reports whose figures are built but saved as empty bytes: for tests of which figures a report has
    and where they go, not of how they look (tests/test_report.py renders one figure of each kind, every one in
    a slow test, and checks the PNGs)."""
    from kl_bench.present import report_figures
    monkeypatch.setattr(report_figures, "figure_bytes", unrendered_bytes)


def stub_plot_functions(mp) -> None:
    """Every plot function of the report's figures returns an empty figure (``mp``: a pytest.MonkeyPatch)."""
    from matplotlib.figure import Figure
    from kl_bench.present import plots, report_figures
    for kind in report_figures.FIGURES.values():
        mp.setattr(plots, kind.plot, lambda *args, **kwargs: Figure())


@pytest.fixture
def unbuilt_figures(unrendered_figures, monkeypatch):
    """Reports whose figures are neither drawn nor rendered (stub_plot_functions): for tests of a report's file
    names and pages whose figures, from the same data, another test draws (building them took most of the time)."""
    stub_plot_functions(monkeypatch)


# Test files of the optional extras (hf: your own models; trl: the trainer audit). They skip where the extra
# is missing; .ci/run installs the extras and runs them with `-m 'slow or extras'`, where they must not skip.
EXTRAS_FILES = {"test_model.py", "test_trainer_inputs.py", "test_audit_trl.py"}
# Tests inside other files that need an extra (the tiny models: transformers): marked extras by name.
EXTRAS_TESTS = {"test_a_tiny_model_generating_in_bf16_as_the_engine"}


# The files that take the most worker time (measured on 2 cores: the slow set's torchrun, benchmark and
# signal tests; the default set's report and plot tests), heaviest first. `--dist loadfile` hands whole
# files to the workers in collection order, so these go first and the light files fill the tail: a
# file of 100 s started last would leave the other worker idle for most of it.
HEAVY_FIRST = ("test_distributed.py", "test_benchmarks.py", "test_atomic.py", "test_audit_trl.py", "test_model.py",
               "test_plots.py", "test_report.py", "test_multinomial.py", "test_signals.py", "test_rollout_gradients.py",
               "test_rollout_device.py", "test_terminal.py", "test_audit.py", "test_training.py")


# Test files whose assertions are numerical (exact oracles, bit-for-bit trainer formulas, determinism,
# exact zeros): .ci/run runs them a second time under ATEN_CPU_CAPABILITY=default, so that a result that
# depends on the CPU's vector width (torch picks AVX-512, AVX2 or plain kernels at run time; their sums
# round differently) fails CI on any machine, not only on the machine whose kernels differ.
NUMERICS_FILES = {"test_chunking.py", "test_output.py", "test_counts.py", "test_exact.py", "test_precision.py",
                  "test_estimators.py", "test_presets.py", "test_topk.py", "test_ukl.py", "test_lambdas.py",
                  "test_rollout_blocks.py", "test_audit_session.py"}
# The files of bit-for-bit and exact-to-rounding assertions only (bytes across chunk sizes and processes, exact
# sums, the presets' formulas, float64 moments): the second run is kept to these so that .ci/run stays under 15
# minutes. Files that compare Monte Carlo draws with exact values within 5 SE (a kernel's rounding moves a draw by
# ulps, far inside the SE), and the audit's and gradients' tolerance-based checks, run once, on the native kernels.


def pytest_collection_modifyitems(items):
    for item in items:
        # Every warning in a test is an error. Prepended: a test's or a module's own filterwarnings marks
        # are applied after it and win (pytest applies an item's marks closest first, each new filter in
        # front). Not in pyproject's filterwarnings: there it would also turn a third-party plugin's
        # warning at configuration into an INTERNALERROR (pyproject.toml).
        item.add_marker(pytest.mark.filterwarnings("error"), append=False)
        if item.path.name in EXTRAS_FILES or item.originalname in EXTRAS_TESTS:
            item.add_marker(pytest.mark.extras)
        if item.path.name in NUMERICS_FILES:
            item.add_marker(pytest.mark.numerics)
    # A stable sort: the order within a file, and of the other files, is unchanged.
    items.sort(key=lambda it: HEAVY_FIRST.index(it.path.name) if it.path.name in HEAVY_FIRST else len(HEAVY_FIRST))


def logged_logprobs(n=512, t=16, v=20, seed=0):
    """A trainer's log: per-token log-probs of sampled tokens under q and p, a mask, and kl_full."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(n, t, v, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(n, t, v, generator=g, dtype=torch.float64), -1)
    x = torch.multinomial(lq.exp().reshape(-1, v), 1, generator=g).reshape(n, t)
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (n,), generator=g)[:, None]).double()
    return {"logp_policy": lq.gather(-1, x[..., None])[..., 0], "logp_ref": lp.gather(-1, x[..., None])[..., 0],
            "mask": mask, "kl_full": (lq.exp() * (lq - lp)).sum(-1)}


@pytest.fixture(scope="session")
def gauss_results(tmp_path_factory):
    """A sound results folder of tests.helpers.GAUSS_SPEC, its spec, a baseline and a checkpoint that --resume
    accepts, built once per worker: {"root", "spec", "res", "base", "ck"}. Read only: copy it to change it
    (:func:`gauss_folder`)."""
    from .helpers import build_gauss_results
    return build_gauss_results(tmp_path_factory.mktemp("gauss-results"))


@pytest.fixture
def gauss_folder(gauss_results, tmp_path):
    """A copy of gauss_results' results folder, to damage."""
    import shutil
    return Path(shutil.copytree(gauss_results["res"], tmp_path / "r"))


@pytest.fixture
def small_spec(tmp_path):
    """tests.helpers.GAUSS_SPEC written to tmp_path/h.toml."""
    from .helpers import gauss_spec
    return gauss_spec(tmp_path, "h")


@pytest.fixture
def no_hang():
    """A probe that would block on a FIFO fails after 20 s instead of hanging the suite."""
    import signal

    def alarm(signum, frame):
        raise TimeoutError("blocked: a FIFO was opened for reading")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def checked_run(tmp_path_factory):
    """A small run (a live Result), its folder, the folder read back, and another experiment's spec."""
    import kl_bench
    where = tmp_path_factory.mktemp("check")
    exp = {"draws": 20_000, "seed": 0, "device": "cpu", "batches": 20, "estimators": ["k1", "k3"]}
    mine, other = where / "mine.toml", where / "other.toml"
    mine.write_text(spec_toml({"name": "mine", **exp}, [GAUSS, CATEGORICAL]))
    other.write_text(spec_toml({"name": "other", **exp}, [GAUSS, CATEGORICAL]))
    live = kl_bench.run(mine)
    folder = live.write(where / "results")
    return live, folder, kl_bench.load_results(folder), mine, other


@pytest.fixture
def handlers():
    """cli.main (the console script, called in the test's process) installs signal handlers: restore pytest's
    afterwards."""
    import signal

    from kl_bench.foundation import signals
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    signals.seen[0] = 0
