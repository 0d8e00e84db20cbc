"""kl_bench.present.plots: importing it and plotting leave matplotlib's global state (rcParams, seaborn's theme,
the backend) as they were; every plot function draws a small frame of each results file's columns, on a
new figure or on given axes, and returns the figure; the report's look survives rendering outside the
plot function."""
import copy
import functools
import io
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kl_bench.results import GRAD_SCHEMA
from kl_bench.experiment.lambdas import SWEEP_SCHEMA
from kl_bench.results import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("case", "kind", "estimator", "aggregate", "target", "heavy_tail", "sampler")   # as load_results reads them
NAN, INF = math.nan, math.inf


# ----------------------------------------------------------------------------- small frames
def _frame(rows: list[dict], columns) -> pd.DataFrame:
    df = pd.DataFrame([{c: r.get(c, NAN) for c in columns} for r in rows], columns=list(columns))
    for c in TEXT:
        if c in df:
            df[c] = df[c].astype(object).where(df[c].notna(), "")
    return df


def summary_frame() -> pd.DataFrame:
    """summary.csv rows: a Gaussian case (k1, k2, k3 and one cv(λ) row) and two rollout lengths."""
    rows = []

    def add(case, kind, est, agg="", lam=NAN, true=0.13, rel_bias=0.0, rel_std=2.0, exact_rel_std=None,
            n10=None):
        exact_rel_std = rel_std * 1.05 if exact_rel_std is None else exact_rel_std
        measured_bias = rel_bias + 0.004 * (len(rows) % 3 - 1)
        rows.append(dict(
            case=case, kind=kind, estimator=est, aggregate=agg, **{"lambda": lam}, target="KL(q||p)", true_kl=true,
            draws=20_000, batches=20, mean=true * (1 + measured_bias), std=true * rel_std,
            se=true * rel_std / math.sqrt(20_000), std_se=0.02 * true * rel_std, bias=true * measured_bias,
            rel_bias=measured_bias, rel_std=rel_std, exact_mean=true * (1 + rel_bias),
            exact_std=true * exact_rel_std, exact_rel_bias=rel_bias, exact_rel_std=exact_rel_std, z=0.3,
            frac_negative=0.1, n_for_10pct=(1.96 * rel_std / 0.1) ** 2 if n10 is None else n10))

    add("gauss", "gaussian", "k1", rel_std=7.5)
    add("gauss", "gaussian", "k2", rel_bias=-0.29, rel_std=1.7, n10=INF)   # bias alone > 10%: no bar
    add("gauss", "gaussian", "k3", rel_std=5.1)
    add("gauss", "gaussian", "cv", lam=0.5, rel_std=3.9)
    for case, t in (("roll-T4", 4), ("roll-T8", 8)):
        for agg in ("seq", "tok"):
            add(case, "rollout", "k1", agg, true=0.05 * t, rel_std=3.0 / math.sqrt(t))
            add(case, "rollout", "k3", agg, true=0.05 * t, rel_std=2.0 * t ** 0.3,
                exact_rel_std=INF if (agg, t) == ("seq", 8) else None)
    return _frame(rows, SCHEMA)


def batches_frame(summary: pd.DataFrame, case: str = "gauss", n: int = 20) -> pd.DataFrame:
    """batches.csv rows of one case: n batch means per row around its exact mean."""
    rng = np.random.default_rng(0)
    rows = []
    for _, r in summary[(summary["case"] == case) & summary["lambda"].isna()].iterrows():
        for b in range(n):
            rows.append(dict(case=case, estimator=r["estimator"], aggregate=r["aggregate"], **{"lambda": NAN},
                             batch=b, draws=1000, batch_mean=r["exact_mean"] + r["std"] / 30 * rng.standard_normal()))
    df = pd.DataFrame(rows)
    df["aggregate"] = df["aggregate"].astype(object)
    return df


def sweep_frame() -> pd.DataFrame:
    """lambda_sweep.csv rows of one case: a λ grid through 0 (k1) and 1 (k3), infinite exact std at λ = 2."""
    lams = np.round(np.linspace(-0.5, 2.0, 11), 2)
    star = 0.6
    exact = 2.0 + 3.0 * (lams - star) ** 2
    exact[lams == 2.0] = INF
    return _frame([dict(case="gauss", aggregate="", **{"lambda": lam}, true_kl=0.13, mean=0.13, se=0.001,
                        std=0.13 * e * 0.97 if math.isfinite(e) else 0.13 * 9.0, rel_std=e * 0.97 if math.isfinite(e)
                        else 9.0, exact_mean=0.13, exact_std=0.13 * e, exact_rel_std=e, p_negative_exact=0.2,
                        frac_negative=0.2, lambda_star=star, lambda_star_mc=0.58)
                   for lam, e in zip(lams, exact)], SWEEP_SCHEMA)


def gradients_frame() -> pd.DataFrame:
    """gradients.csv rows of one case: estimator × mode, one without an exact trace (measured one used)."""
    rows = []
    for k, (est, lam) in enumerate((("k1", NAN), ("k3", NAN), ("cv", 0.5))):
        for j, mode in enumerate(("loss", "reward", "loss_is")):
            along = 0.0 if (est, mode) == ("k1", "loss") else 0.2 + 0.1 * j
            rows.append(dict(case="gauss", estimator=est, aggregate="", **{"lambda": lam}, sampler="", mode=mode,
                             params=2, draws=100_000, equals="reverse", trace_cov=3.0 + k,
                             exact_trace_cov=NAN if (est, mode) == ("cv", "loss_is") else 3.0 + k + 0.1 * j,
                             exact_along_reverse=along, exact_norm=max(along, 0.05) * 1.1, n_for_cos90=100.0))
    return _frame(rows, GRAD_SCHEMA)


def distribution_values() -> pd.DataFrame:
    rng = np.random.default_rng(1)
    logr = rng.normal(-0.1, 0.5, 2000)
    r = np.exp(logr)
    values = {"k1": -logr, "k2": logr**2 / 2, "k3": r - 1 - logr}
    return pd.concat([pd.DataFrame({"label": k, "value": v}) for k, v in values.items()], ignore_index=True)


def sweep_summary() -> pd.DataFrame:
    """summary.csv rows of a [[sweep]]: the Gaussian rows at five noise values × two temperatures."""
    gauss = summary_frame().query("case == 'gauss'")
    parts = []
    for noise in (0.01, 0.03, 0.1, 0.3, 1.0):
        for temp in (0.8, 1.0):
            d = gauss.copy()
            d["case"] = f"g[noise={noise:g};temperature={temp:g}]"
            d[["rel_std", "exact_rel_std"]] = d[["rel_std", "exact_rel_std"]] / noise ** 0.5
            d["rel_bias"] = d["rel_bias"] + (1 - temp)
            d["sweep.noise"], d["sweep.temperature"] = noise, temp
            parts.append(d)
    return pd.concat(parts, ignore_index=True)


def calls():
    """name → (function name, args, kwargs, name of the axes argument, subplot grid for given axes): a fresh copy
    each time (a plot function that changed its frame would change no other test's), made once (70 ms a build,
    which the plot tests below asked for 60 times)."""
    return copy.deepcopy(_calls())


@functools.cache
def _calls():
    s = summary_frame()
    gauss = s[s["case"] == "gauss"]
    return {
        "bias_std": ("plot_bias_std", (gauss,), {"title": "gauss"}, "axes", (1, 2)),
        "bias_std_two_runs": ("plot_bias_std", (pd.concat([gauss.assign(run="a"), gauss.assign(run="b")]),), {},
                              "axes", (1, 2)),
        "lambda_curve": ("plot_lambda_curve", (sweep_frame(),), {"title": "gauss"}, "ax", (1, 1)),
        "distribution": ("plot_distribution", (distribution_values(),), {"title": "gauss"}, "ax", (1, 1)),
        "convergence": ("plot_convergence", (batches_frame(s), gauss), {"title": "gauss"}, "axes", (2, 3)),
        "rollout_growth": ("plot_rollout_growth", (s, {"roll-T4": 4, "roll-T8": 8}), {"title": "rollouts"}, "ax",
                           (1, 1)),
        "planning": ("plot_planning", (s,), {"title": "small"}, "ax", (1, 1)),
        "gradient_cosine": ("plot_gradient_cosine", (gradients_frame(),), {"title": "gauss"}, "ax", (1, 1)),
        "sweep": ("plot_sweep", (sweep_summary(), "sweep.temperature"), {"title": "sweep"}, "axes", (1, 2)),
        "sweep_faceted": ("plot_sweep", (sweep_summary()[lambda d: d["sweep.temperature"] == 0.8], "sweep.noise"),
                          {}, "axes", (1, 2)),
    }


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def plots():
    from kl_bench.present import plots
    return plots


def _rc() -> dict:
    import matplotlib
    return dict(matplotlib.rcParams)


def _call(plots, name: str, **extra):
    """Call one plot function; rcParams must be exactly as before the call."""
    fn_name, args, kwargs, _, _ = calls()[name]
    before = _rc()
    fig = getattr(plots, fn_name)(*args, **kwargs, **extra)
    assert _rc() == before, f"{fn_name} changed rcParams: {_rc_diff(before, _rc())}"
    return fig


def _rc_diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def _pixels(fig, **savefig) -> np.ndarray:
    from matplotlib.image import imread
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60, **savefig)
    data = buf.getvalue()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(io.BytesIO(data))


# ----------------------------------------------------------------------------- global state
# Run in a fresh interpreter: nothing of kl_bench.present.plots (or seaborn) may be imported before the snapshot.
FRESH = """
import io
import matplotlib
from matplotlib import colors
backend = matplotlib.get_backend()
before = dict(matplotlib.rcParams)
codes = {c: colors.to_rgba(c) for c in "bgrcmyk"}
def check(when):
    now = dict(matplotlib.rcParams)
    diff = {k: (before.get(k), now.get(k)) for k in before.keys() | now.keys() if before.get(k) != now.get(k)}
    assert not diff, f"rcParams changed {when}: {diff}"
    assert matplotlib.get_backend() == backend, f"backend {backend} -> {matplotlib.get_backend()} {when}"
    assert {c: colors.to_rgba(c) for c in "bgrcmyk"} == codes, f"colour codes changed {when}"
from tests import test_plots as t
check("importing the tests' frames")
from kl_bench.present import plots
check("importing kl_bench.present.plots")
for name, (fn, args, kwargs, _, _) in t.calls().items():
    fig = getattr(plots, fn)(*args, **kwargs)
    check(f"calling {fn} ({name})")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\\x89PNG"
    check(f"saving the figure of {fn} ({name})")
print("clean", backend)
"""


# svg: a non-Agg backend stays selected (the module used to force Agg), every plot function is called on it and
# its PNG still renders. The run on the default backend (Agg where there is no display) is slow: rcParams, the
# theme and the colour codes are checked alike on either, and a forced Agg shows only under another backend, so
# the svg run catches what it catches; a fresh interpreter costs ~6 s of CPU (torch, seaborn, matplotlib anew).
@pytest.mark.parametrize("backend", ["svg", pytest.param(None, marks=pytest.mark.slow)])
def test_import_and_plotting_leave_rcparams_theme_and_backend_alone(backend):
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if backend:
        env["MPLBACKEND"] = backend
    proc = subprocess.run([sys.executable, "-W", "error", "-c", FRESH], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "clean"
    if backend:
        assert proc.stdout.split() == ["clean", backend]


def test_rcparams_are_restored_when_a_plot_function_fails(plots):
    before = _rc()
    with pytest.raises(KeyError):
        plots.plot_lambda_curve(pd.DataFrame({"x": [1.0]}))
    assert _rc() == before


def _results():
    """One run's results (kl_bench.present.report_data.Results) made of the small frames: every figure has panels."""
    from kl_bench.present.report_data import Results
    s = summary_frame()
    cases = {"gauss": {"length": None, "label": ""}, "roll-T4": {"length": 4, "label": "roll"},
             "roll-T8": {"length": 8, "label": "roll"},
             "model": {"growth": {"T": [1, 2, 4], "paths": 500, "tok k3": [1.0, 1.4, 2.0], "tok full": [0.5, 0.6, None]}}}
    draws = distribution_values()
    reservoir = {f"gauss|{k}": draws.loc[draws["label"] == k, "value"].to_numpy() for k in ("k1", "k2", "k3")}
    batches = pd.concat([batches_frame(s, case) for case in dict.fromkeys(s["case"])], ignore_index=True)
    return Results(Path("run"), "run", s, {"cases": cases}, sweep_frame(), batches, reservoir, gradients_frame())


def _figure_panels():
    from kl_bench.present.report_figures import FIGURES, FigureContext
    res = _results()
    df = pd.concat([res.summary, sweep_summary()], ignore_index=True)
    top = FigureContext([res], df, set(sweep_summary()["case"]))
    run = FigureContext([res], df, top.swept, res, res.summary)
    return {name: list(kind.panels(run if kind.per_run else top)) for name, kind in FIGURES.items()}


def test_every_registered_figure_takes_a_frame_and_axes_and_returns_its_figure(plots):
    """Each figure of the report's registry draws its panels from a DataFrame, on a new figure or on given
    axes, leaves rcParams and pyplot alone, and is exercised by the plot tests below."""
    from matplotlib.figure import Figure
    from matplotlib.pyplot import get_fignums
    from kl_bench.present.report_figures import FIGURES
    assert {k.plot for k in FIGURES.values()} <= {fn for fn, *_ in calls().values()}
    for name, panels in _figure_panels().items():
        assert panels, f"figure {name}: no panel from results that hold every table"
        fn = getattr(plots, FIGURES[name].plot)
        for p in panels[:2]:
            assert isinstance(p.data, pd.DataFrame) and p.file.endswith(".png") and p.caption
            before, open_before = _rc(), get_fignums()
            fig = fn(p.data, title=p.title, **p.kwargs)
            assert isinstance(fig, Figure) and _rc() == before and get_fignums() == open_before
            # given axes: as many as it made itself where it takes several ("axes"), else one
            ax_arg = "axes" if "axes" in inspect.signature(fn).parameters else "ax"
            target = Figure().subplots(1, len(fig.axes)) if ax_arg == "axes" else Figure().subplots()
            assert fn(p.data, title=p.title, **p.kwargs, **{ax_arg: target}) is np.atleast_1d(target).ravel()[0].figure


def test_a_figure_registered_from_a_test_is_in_the_report(plots, unbuilt_figures):
    """A new figure is one decorated function: build_figures draws it with the others (neither built nor
    rendered: the names and their order are the question; the test above builds each figure's panels)."""
    from kl_bench.present import report_figures as R
    res = _results()

    @R.figure("toy_std", "plot_planning", per_run=True)
    def _toy(ctx):
        yield R.Panel("toy.png", "toy: the planning bars again", "toy", ctx.s)
    try:
        df = res.summary.assign(label=[R.row_label(r) for _, r in res.summary.iterrows()])
        names = [name for name, _, _ in R.build_figures([res], df, ("png",))]
    finally:
        R.FIGURES.remove("toy_std")
    assert names.index("toy.png") == names.index("planning.png") + 1
    assert {"bias_std_gauss.png", "lambda_gauss.png", "distribution_gauss.png", "convergence_gauss.png",
            "rollout_growth_0.png", "gradient_cosine_gauss.png"} <= set(names)


# ----------------------------------------------------------------------------- each plot function
@pytest.mark.parametrize("name", list(calls()))
def test_plot_returns_a_new_figure_with_drawn_axes_and_its_look_survives_saving_outside_the_function(plots, name):
    """A new figure, not pyplot's, every panel drawn on, not blank; and since the report saves after the function
    returned, it renders as if the theme were still active (the same pixels as a figure saved inside it)."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.pyplot import get_fignums
    from kl_bench.present.plot_helpers import THEME
    open_before = get_fignums()
    fig = _call(plots, name)
    assert isinstance(fig, Figure)
    assert get_fignums() == open_before          # not a pyplot figure: nothing to close, no backend needed
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert visible
    for ax in visible:
        assert ax.lines or ax.collections or ax.patches, f"{name}: an empty panel"
    before = _rc()
    img = _pixels(fig)
    assert _rc() == before
    assert img.shape[0] > 50 and img.shape[1] > 50 and img[..., :3].std() > 0.05   # not a blank image
    with matplotlib.rc_context(THEME):
        inside = _pixels(_call(plots, name))
    assert img.shape == inside.shape and np.array_equal(img, inside)


@pytest.mark.parametrize("name", list(calls()))
def test_plot_draws_on_given_axes_and_returns_their_figure(plots, name):
    from matplotlib.figure import Figure
    _, _, _, arg, (nrows, ncols) = calls()[name]
    fig = Figure(figsize=(4 * ncols, 3 * nrows))
    given = fig.subplots(nrows, ncols)
    assert _call(plots, name, **{arg: given}) is fig
    assert len(fig.axes) == nrows * ncols        # drew on them, added no axes
    first = np.atleast_1d(given).ravel()[0]
    assert first.lines or first.collections or first.patches
    _pixels(fig)


def test_figures_have_the_whitegrid_notebook_colorblind_look(plots):
    import matplotlib
    import seaborn as sns
    from matplotlib.colors import same_color, to_rgba
    from kl_bench.present import figstyle
    from kl_bench.present.plot_helpers import PALETTE
    assert PALETTE == sns.color_palette("colorblind")
    assert list(figstyle.COLORBLIND) == sns.color_palette("colorblind").as_hex()
    ax = _call(plots, "lambda_curve").axes[0]
    assert same_color(ax.lines[0].get_color(), figstyle.estimator_colour("cv"))     # the exact curve: cv(λ)'s
    assert same_color(ax.get_facecolor(), "white")
    assert all(same_color(s.get_edgecolor(), to_rgba(".8")) for s in ax.spines.values())
    tick = ax.xaxis.get_major_ticks()[0]
    assert tick.gridline.get_visible() and same_color(tick.gridline.get_color(), to_rgba(".8"))
    notebook = sns.plotting_context("notebook")
    assert tick.label1.get_fontsize() == notebook["xtick.labelsize"]
    assert ax.xaxis.label.get_fontsize() == notebook["axes.labelsize"]
    assert ax.title.get_fontsize() == notebook["axes.titlesize"]
    assert ax.lines[0].get_linewidth() == 2                                # explicit lw wins
    assert ax.lines[1].get_linewidth() == 1.5
    assert matplotlib.rcParams["axes.grid"] == matplotlib.rcParamsDefault["axes.grid"]  # only inside the function


def test_report_png_closes_a_figure_that_pyplot_does_not_manage(plots):
    """kl_bench.present.report_figures.figure_bytes calls plt.close(fig): harmless on a plain Figure, and no figure stays open."""
    from matplotlib.pyplot import get_fignums
    from kl_bench.present.report_figures import figure_bytes
    open_before = get_fignums()
    # any figure shows it: one panel renders in a third of the time
    data = figure_bytes(_call(plots, "lambda_curve"), ("png",))["png"]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert get_fignums() == open_before


# ----------------------------------------------------------------------------- readability (issue 13, item 8)
def _render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def _legend_texts(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    return [t.get_text() for leg in legends if leg is not None for t in leg.get_texts()]


@pytest.mark.parametrize("lo, hi", [(-6.5, 10.1), (-0.3, 0.002), (1e-4, 3.0), (-50.0, -0.01), (-1e-4, 1e-4)])
def test_bias_axis_ticks_are_few_readable_and_never_overlap(plots, lo, hi):
    s = summary_frame()
    gauss = s[(s["case"] == "gauss") & s["lambda"].isna()].copy()
    values = np.linspace(lo, hi, len(gauss))
    gauss["rel_bias"] = values
    gauss["exact_rel_bias"] = values
    fig = plots.plot_bias_std(gauss, title="range")
    renderer = _render(fig)
    ax = fig.axes[0]
    lim = ax.get_xlim()
    labels = [t for t in ax.get_xticklabels() if t.get_text() and lim[0] <= t.get_position()[0] <= lim[1]]
    assert 2 <= len(labels) <= 7, [t.get_text() for t in labels]
    for t in labels:                       # plain percentages, no 10^k mathtext
        assert "$" not in t.get_text() and (t.get_text() == "0" or t.get_text().endswith("%")), t.get_text()
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 + 2 <= b.x0, "tick labels overlap"
    assert min(lim) <= min(values) and max(lim) >= max(values)       # every point inside the axis


def test_gradient_cosine_is_faceted_by_mode_with_one_legend(plots):
    grads = gradients_frame()
    fig = _call(plots, "gradient_cosine")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    modes = list(dict.fromkeys(grads["mode"]))
    assert len(panels) == len(modes)
    from kl_bench.core.modes import MODES
    assert [ax.get_title() for ax in panels] == [f"mode: {m}\n({MODES[m].label})" for m in modes]
    for ax, mode in zip(panels, modes):
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
        assert len(curves) == (grads["mode"] == mode).sum()
        colours = [line.get_color() for line in curves]
        assert len(set(map(str, colours))) == len(colours)          # one colour per estimator in a panel
    texts = _legend_texts(fig)
    assert sorted(texts) == sorted(["k1", "k3", "cv(0.5)", "cos = 0.9"])


def test_gradient_cosine_on_one_axis_gives_every_line_its_own_look(plots):
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure
    fig = Figure()
    ax = fig.subplots()
    plots.plot_gradient_cosine(gradients_frame(), ax=ax)
    curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
    looks = [(to_hex(line.get_color()), line.get_linestyle()) for line in curves]
    assert len(curves) == len(gradients_frame()) and len(set(looks)) == len(looks)


def test_no_legend_entry_for_a_line_that_is_not_drawn(plots):
    sweep = sweep_frame().assign(exact_rel_std=INF, exact_std=INF)     # no finite exact curve
    fig = plots.plot_lambda_curve(sweep, title="no exact")
    assert "exact" not in _legend_texts(fig) and "measured (one pass)" in _legend_texts(fig)
    s = summary_frame()
    gauss = s[s["case"] == "gauss"].assign(exact_rel_std=INF)          # no exact × on the std panel
    fig = plots.plot_bias_std(gauss)
    assert "exact" not in _legend_texts(fig)
    fig = _call(plots, "bias_std")
    assert "exact" in _legend_texts(fig)


def test_planning_keeps_every_row_in_place_and_marks_never_there(plots):
    """A row whose bias alone exceeds 10% keeps its slot in its case's group, marked "never" in its
    estimator's colour (it used to be a list in the title); nothing is drawn outside the figure."""
    from matplotlib.colors import same_color
    from kl_bench.present.figstyle import estimator_colour
    s = summary_frame()
    many = pd.concat([s.assign(case=s["case"] + f"-a-long-case-name-{k}", n_for_10pct=INF) for k in range(6)]
                     + [s])
    fig = plots.plot_planning(many, title="many cases")
    renderer = _render(fig)
    ax = fig.axes[0]
    nevers = [t for t in ax.texts if t.get_text().endswith(": never")]
    rows = many[many["lambda"].isna()]
    assert len(nevers) == int((~np.isfinite(rows["n_for_10pct"].astype(float))).sum())
    assert all(same_color(t.get_color(), estimator_colour(t.get_text().split()[-2].rstrip(":"))) for t in nevers)
    bars = [p for p in ax.patches if p.get_width() > 0]
    assert len(bars) == int(np.isfinite(rows["n_for_10pct"].astype(float)).sum())
    assert [t.get_text() for t in ax.get_yticklabels()] == list(dict.fromkeys(rows["case"]))
    inside = ax.get_window_extent(renderer)
    for text in ax.texts:                        # every slot inside the axes, the first and last too
        box = text.get_window_extent(renderer)
        assert inside.y0 <= box.y0 and box.y1 <= inside.y1 and inside.x0 <= box.x0, text.get_text()
    for artist in [ax.title, ax.xaxis.label, *ax.get_yticklabels()]:
        box = artist.get_window_extent(renderer)
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= fig.bbox.width + 0.5 and \
            box.y1 <= fig.bbox.height + 0.5, artist.get_text()


# ----------------------------------------------------------------------------- colours and visibility (issue 31 item 5)
def _colours(fig) -> set[str]:
    from matplotlib.colors import to_hex
    out = set()
    for ax in fig.axes:
        out |= {to_hex(line.get_color()) for line in ax.get_lines()}
        out |= {to_hex(c) for coll in ax.collections for c in np.atleast_2d(coll.get_facecolor()) if len(c)}
        out |= {to_hex(c) for coll in ax.collections for c in np.atleast_2d(coll.get_edgecolor()) if len(c)}
        out |= {to_hex(p.get_facecolor()) for p in ax.patches}
    return out


def test_a_colour_is_the_estimators_in_every_figure_whichever_estimators_a_run_has(plots):
    """k1 is the same colour in every figure, first or last, alone or with others: colours follow the
    estimator, not its position (they used to follow the position: fwd_k3 took abs's colour in a sweep)."""
    from kl_bench.present.figstyle import estimator_colour
    s = summary_frame()
    gauss = s[s["case"] == "gauss"]
    k1, k3 = estimator_colour("k1"), estimator_colour("k3")
    assert len({estimator_colour(e) for e in ("k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full", "cv")}) == 8
    assert estimator_colour("cv(0.5)") == estimator_colour("cv")
    import kl_bench
    own = [n for n in kl_bench.ESTIMATORS if not n.endswith("+")] + ["full", "cv", "cv_opt"]
    assert len({estimator_colour(n) for n in own}) == len(own)          # every registered one its own colour
    assert estimator_colour("verl.kl+") == estimator_colour("verl.kl")   # the same value: its base's colour
    only_k3_then_k1 = gauss[gauss["estimator"].isin(["k3", "k1"])].iloc[::-1]
    draws = distribution_values()
    reversed_draws = draws[draws["label"].isin(["k3", "k1"])].iloc[::-1]
    figures = {
        "bias_std": [plots.plot_bias_std(gauss), plots.plot_bias_std(only_k3_then_k1)],
        "distribution": [plots.plot_distribution(draws), plots.plot_distribution(reversed_draws)],
        "convergence": [plots.plot_convergence(batches_frame(s), gauss),
                        plots.plot_convergence(batches_frame(s), only_k3_then_k1)],
        "planning": [plots.plot_planning(s), plots.plot_planning(only_k3_then_k1)],
        "sweep": [plots.plot_sweep(sweep_summary(), "sweep.temperature"),
                  plots.plot_sweep(sweep_summary()[lambda d: d["estimator"].isin(["k3", "k1"])].iloc[::-1],
                                   "sweep.temperature")],
        "gradient_cosine": [plots.plot_gradient_cosine(gradients_frame()),
                            plots.plot_gradient_cosine(gradients_frame().iloc[::-1])],
        "rollout_growth": [plots.plot_rollout_growth(s, {"roll-T4": 4, "roll-T8": 8})],
    }
    for name, figs in figures.items():
        for fig in figs:
            assert {k1, k3} <= _colours(fig), (name, _colours(fig))


def test_lines_that_coincide_in_an_ecdf_all_stay_visible(plots):
    """k2, k3 and fwd_k3 with the very same draws (as at small KL): each one's colour still covers pixels
    of the curve (the legend taken away), because the first is drawn widest and the later ones narrower and
    dashed on top; a line apart from the others is drawn plainly."""
    from matplotlib.colors import to_rgb
    from kl_bench.present.figstyle import estimator_colour
    rng = np.random.default_rng(2)
    v = rng.gamma(0.5, 0.01, 3000)
    draws = pd.concat([pd.DataFrame({"label": k, "value": v}) for k in ("k2", "k3", "fwd_k3")]
                      + [pd.DataFrame({"label": "k1", "value": rng.normal(0.0, 0.05, 3000)})], ignore_index=True)
    fig = plots.plot_distribution(draws)
    ax = fig.axes[0]
    ax.get_legend().remove()
    for line in [*ax.get_lines()]:
        if line.get_linestyle() == "None":          # the quantile markers: the curves alone are the question
            line.remove()
    img = _pixels(fig)[..., :3]
    for name in ("k2", "k3", "fwd_k3", "k1"):
        target = np.array(to_rgb(estimator_colour(name)))
        near = (np.abs(img - target).max(axis=-1) < 0.06).sum()
        assert near > 30, (name, near)
    widths = {line.get_label(): line.get_linewidth() for line in ax.get_lines()}
    assert widths["k2"] > widths["k3"] > widths["fwd_k3"] and widths["k1"] < widths["k2"]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_titles_never_run_under_a_legend(plots):
    """The sweep figure's title and legend (and the training figure's) do not overlap: the legend sits
    under the panels."""
    import kl_bench.api as api
    from kl_bench.present.training_plots import plot_training
    from tests.test_training import _spec
    long = sweep_summary().assign(case=lambda d: d["case"] + "-a-much-longer-case-name")
    train = api.train(_spec({"gradients": ["exact"], "steps": 2})).frame
    title = "estimators across the sweep of sampler.temperature"        # + " (at noise = 0.1)"
    for fig in (plots.plot_sweep(long, "sweep.temperature", title=title),
                plots.plot_sweep(long, "sweep.noise", title="estimators across the sweep of p.noise"),
                plot_training(train)):
        renderer = _render(fig)
        title = fig._suptitle.get_window_extent(renderer)
        for legend in fig.legends:
            assert not _overlap(title, legend.get_window_extent(renderer))
        assert title.x0 >= 0 and title.x1 <= fig.bbox.width


def test_the_audit_step_axis_holds_whole_steps():
    from tests.test_audit import _gen, _steps
    from kl_bench.audit import AuditLog, Sampler, audit_step
    from kl_bench.present.audit_report import plot_audit
    for n, every in ((3, 1), (4, 10), (30, 1)):
        log = AuditLog()
        for s, (pv, values, mask) in enumerate(_steps(_gen(5), Sampler(top_k=5), n)):
            log.add(audit_step(pv, values, mask, estimator="trl.grpo", step=every * s, source="loss"))
        fig = plot_audit(pd.DataFrame([vars(a) for a in log.rows]), "loss")
        _render(fig)
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() and t >= 0 for t in ticks), (n, every, ticks)


# ----------------------------------------------------------------------------- nothing above 0 on a log axis
def _save(fig) -> bytes:
    from kl_bench.present.pages import figure_bytes
    return figure_bytes(fig)["png"]


def test_a_log_axis_with_no_value_above_zero_is_linear_and_says_so(plots):
    """Every per-draw std 0 (a Rao–Blackwellised row alone: each draw is the exact KL) leaves the std panel
    with nothing a log axis can show: matplotlib warns (an error here, conftest) or refuses; it is drawn
    linear, its label saying why. A true KL of 0 on a case's rows draws no infinite CI."""
    g = summary_frame().query("case == 'gauss' and `lambda` != `lambda`").copy()
    g[["std", "std_se", "rel_std", "exact_std", "exact_rel_std"]] = 0.0
    fig = plots.plot_bias_std(g, title="all std 0")
    assert fig.axes[1].get_xscale() == "linear" and "no value > 0" in fig.axes[1].get_xlabel()
    assert len(_save(fig)) > 1000
    zero = summary_frame().query("case == 'gauss' and `lambda` != `lambda`").assign(true_kl=0.0)
    assert len(_save(plots.plot_bias_std(zero, title="KL 0"))) > 1000
    fig = plots.plot_bias_std(summary_frame().query("case == 'gauss'"), title="usual")
    assert fig.axes[1].get_xscale() == "log" and fig.axes[1].get_xlabel().endswith("(log)")
    flat = sweep_frame().assign(rel_std=0.0, exact_rel_std=0.0)
    fig = plots.plot_lambda_curve(flat, title="flat")
    assert fig.axes[0].get_yscale() == "linear" and len(_save(fig)) > 1000


def test_a_training_case_at_the_optimum_has_a_linear_kl_opt_panel():
    """KL(q‖q*) = 0 at every step (vocab = 1: q is q*), with sampled rows and their bands: a log axis
    would raise 'Data cannot be log-scaled'; the panel is linear and says the values are 0."""
    from kl_bench.present.training_plots import PANELS, plot_training
    steps = range(4)
    rows = [dict(case="one", combination=c, estimator=c.split("/")[0], mode=c.split("/")[1], aggregate="",
                 gradients=g, draws=0 if g == "exact" else 8, seeds=1 if g == "exact" else 2, step=s,
                 **{m: 0.0 for m in PANELS}, **{f"{m}_sd": (NAN if g == "exact" else 0.0) for m in PANELS})
            for c in ("k1/reward", "k3/loss") for g in ("exact", "sampled") for s in steps]
    fig = plot_training(pd.DataFrame(rows))
    kl_opt = fig.axes[PANELS.index("kl_opt")]
    assert kl_opt.get_yscale() == "linear" and "0 at every step" in kl_opt.get_title()
    assert len(_save(fig)) > 1000


def test_a_rounding_level_std_does_not_set_the_std_axis():
    """A constant row's exact std at float64 rounding (3.3e-16 of the true KL: the analytic KL of one context
    summed over the vocabulary) is a std of 0: not plotted, and the std axis spans the other rows (it had run
    from 1e-16, every other row squeezed into its last decade)."""
    import pandas as pd
    from kl_bench.present import plots
    rows = [{"case": "c", "estimator": e, "lambda": float("nan"), "aggregate": "", "true_kl": 0.1, "mean": 0.1,
             "se": 0.001, "std": s, "std_se": 0.01, "rel_bias": 0.0, "rel_std": s / 0.1, "exact_rel_bias": 0.0,
             "exact_rel_std": x, "heavy_tail": ""}
            for e, s, x in (("k1", 0.5, 5.0), ("k3", 0.2, 2.0), ("full", 0.0, 3.3e-16))]
    fig = plots.plot_bias_std(pd.DataFrame(rows))
    lo, hi = fig.axes[1].get_xlim()
    assert lo > 0.1 and hi < 20, (lo, hi)


@pytest.mark.parametrize("lo, hi", [(2.1, 2.9), (3.1, 4.9), (0.31, 0.49), (120.0, 180.0), (0.5, 40.0), (1e-3, 1e3)])
def test_every_log_axis_has_at_least_two_labels(lo, hi):
    """plain_log_labels: a log axis that spans less than the gap between its 1s, 2s and 5s (a sweep's std
    panel from 3.1 to 4.9 had no label, one from 2.1 to 2.9 only '2') gets evenly spaced plain ticks; wider
    axes keep the decades (and their 2s and 5s under two decades)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from kl_bench.present.figstyle import plain_log_labels
    fig = Figure()
    ax = fig.subplots()
    ax.plot([0, 1], [lo, hi])
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    ax.set_ylim(lo, hi)
    FigureCanvasAgg(fig).draw()
    shown = [(t.get_loc(), t.label1.get_text()) for t in ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks()
             if t.label1.get_text() and lo <= t.get_loc() <= hi]
    assert len(shown) >= 2, shown
    assert all(float(text) == pytest.approx(loc) for loc, text in shown if not text.startswith("$")), shown
