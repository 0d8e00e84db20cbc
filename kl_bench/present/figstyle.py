"""How every figure draws a row: its colour is its estimator's (k1 is the same blue in every figure of every
report, whichever estimators a run has), its line style and marker are its aggregate's (seq solid with
circles, tok dashed with squares, ...), and in training figures its marker is its mode's.

Foundation layer (matplotlib is imported only inside :func:`plain_log_labels`): the report's figures
(kl_bench.present.plots), the training figures and the audit figures all take their styles and their log-axis
labels from here, so that a colour means one estimator everywhere.

The six estimators of the README's table, ``full``, ``cv`` and ``cv_opt`` have fixed colours from seaborn's
colour-blind palette, the library presets fixed colours of their own; any other estimator (a clamp, a
plug-in) gets a colour from a second palette chosen by a hash of its name: stable from figure to figure and
run to run. Two such estimators can share a colour; :func:`figure_styles` then gives the later one another
marker and line style, so that no two rows of one figure look alike.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

# seaborn's "colorblind" palette (hex; the order seaborn gives it).
COLORBLIND = ("#0173b2", "#de8f05", "#029e73", "#d55e00", "#cc78bc", "#ca9161", "#fbafe4", "#949494", "#ece133",
              "#56b4e9")
ESTIMATOR_COLOURS = {"k1": "#0173b2", "k2": "#de8f05", "k3": "#029e73", "abs": "#d55e00", "fwd_k1": "#cc78bc",
                     "fwd_k3": "#ca9161", "full": "#4d4d4d", "cv": "#56b4e9", "cv_opt": "#b8a300",
                     "bin_kl": "#e7298a", "bin_tv": "#a6761d"}
# The library presets (kl_bench.core.presets), each its own colour, chosen so that the ones a figure shows
# together (experiments/trainers.toml: k3, verl.low_var_kl, openrlhf.k3, nemo.k3, trl.grpo, nemo.k1) differ;
# a "+" variant has its base's value, so its colour (a figure that shows both gives it another marker).
PRESET_COLOURS = {"verl.kl": "#332288", "verl.abs": "#88ccee", "verl.mse": "#999933", "verl.low_var_kl": "#aa4499",
                  "openrlhf.k1": "#882255", "openrlhf.k2": "#ddcc77", "openrlhf.k3": "#44aa99",
                  "trl.grpo": "#cc6677", "trl.ppo_k1": "#6d4c1f", "trl.ppo_k3": "#117733",
                  "nemo.k1": "#1f4e79", "nemo.k2": "#7a7a00", "nemo.k3": "#7570b3"}
# Paul Tol's "muted" palette and a few more, none too close to the colours above: for every other estimator
# (a clamp, a plug-in), by a hash of its name.
OTHER_COLOURS = ("#332288", "#117733", "#44aa99", "#999933", "#cc6677", "#882255", "#aa4499", "#6d4c1f",
                 "#1f4e79", "#7a7a00", "#7570b3", "#e7298a")
# Per aggregate: (line style, marker). Single draws ("") are drawn like seq rows.
AGGREGATE_STYLES = {"": ("-", "o"), "seq": ("-", "o"), "tok": ("--", "s"), "tok_mean": ("-.", "^"),
                    "tok_batch": (":", "v"), "tok_gm": ((0, (5, 1, 1, 1)), "D")}
# Per gradient mode (training figures: one colour per estimator, one marker per mode).
MODE_MARKERS = {"reward": "o", "loss": "s", "loss_is": "^", "straight_through": "P", "loss_is_nemo": "X",
                "reward+loss": "D", "reward_to_go": "v", "reward_partial": "<"}
# Where a row's style repeats another's in one figure: further markers and line styles, in turn.
SPARE_MARKERS = ("X", "P", "*", "h", "<", ">", "d", "p")
SPARE_LINES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class Style:
    """Keyword arguments of matplotlib's ``plot``: colour (hex), line style and marker."""
    color: str
    ls: object
    marker: str

    def kwargs(self) -> dict:
        return {"color": self.color, "ls": self.ls, "marker": self.marker}


def base_estimator(name: str) -> str:
    """The estimator of a row label or a cv row: 'cv(0.5)' → 'cv', 'cv_opt(0.58)' → 'cv_opt', 'k3' → 'k3'."""
    name = str(name)
    head = name.split("(", 1)[0]
    return head if head in ("cv", "cv_opt") else name


def estimator_colour(name: str) -> str:
    """The colour of an estimator (by name; a cv row by its family): fixed for the common ones, a hash of
    the name into :data:`OTHER_COLOURS` for the rest (stable across figures, runs and processes)."""
    base = base_estimator(name)
    if base in ESTIMATOR_COLOURS:
        return ESTIMATOR_COLOURS[base]
    if base.removesuffix("+") in PRESET_COLOURS:
        return PRESET_COLOURS[base.removesuffix("+")]
    return OTHER_COLOURS[zlib.crc32(base.encode()) % len(OTHER_COLOURS)]


def row_style(estimator: str, aggregate: str = "") -> Style:
    """A row's style: its estimator's colour, its aggregate's line style and marker."""
    ls, marker = AGGREGATE_STYLES.get(aggregate if isinstance(aggregate, str) else "", ("-", "o"))
    return Style(estimator_colour(estimator), ls, marker)


def mode_style(estimator: str, mode: str) -> Style:
    """A training combination's style: its estimator's colour and its mode's marker (the line style is
    left to the figure: exact solid, sampled dashed)."""
    return Style(estimator_colour(estimator), "-", MODE_MARKERS.get(mode, "o"))


def figure_styles(keys: list[tuple[str, ...]], style=row_style) -> dict[tuple[str, ...], Style]:
    """{key: Style} for the rows of one figure (``key``: the arguments of ``style``, e.g. (estimator,
    aggregate)), in order: where a key would look exactly like an earlier one (two hashed colours that
    coincide), it gets the next spare marker and line style."""
    out: dict[tuple[str, ...], Style] = {}
    seen: set[tuple] = set()
    spare = 0
    for key in dict.fromkeys(keys):
        s = style(*key)
        while (s.color, str(s.ls), s.marker) in seen and spare < len(SPARE_MARKERS) * len(SPARE_LINES):
            s = replace(s, marker=SPARE_MARKERS[spare % len(SPARE_MARKERS)],
                        ls=SPARE_LINES[(spare // len(SPARE_MARKERS)) % len(SPARE_LINES)])
            spare += 1
        seen.add((s.color, str(s.ls), s.marker))
        out[key] = s
    return out


def _log_label(v: float) -> str:
    """A log-axis tick: plain between 0.001 and 10⁴ (0.5, 2, 300), a power of ten outside (10⁶)."""
    if v <= 0:
        return ""
    if 1e-3 <= v < 1e4:
        return f"{v:g}"
    k = math.log10(v)
    return f"$10^{{{k:.0f}}}$" if abs(k - round(k)) < 1e-9 else ""


def log_labels_in(lo: float, hi: float) -> int:
    """How many labelled ticks a log axis over [lo, hi] gets from :func:`plain_log_labels`' decades and, while
    it spans under two decades, its 2s and 5s."""
    if not (0 < lo <= hi and math.isfinite(hi)):
        return 0
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    marks = [m * 10.0**k for k in range(first, last + 1) for m in ((1, 2, 5) if hi / lo < 100 else (1,))]
    return sum(lo <= v <= hi for v in marks)


MIN_LOG_LABELS = 3       # fewer 1-2-5 labels than this on a log axis: evenly spaced plain ticks instead
# Dashed and dotted lines that stay apart at a figure's line widths (matplotlib's "--" and ":" at 1.2 pt read
# alike in a printed figure): long dashes with wide gaps, and round dots spaced by twice their size.
DASHED = (0, (6, 3))
DOTTED = (0, (1, 2.5))


def plain_log_labels(axis) -> None:
    """Label a log axis with plain numbers (0.5, 2, 30) rather than 5×10⁻¹; the 2s and 5s between the
    decades only while the axis spans under two decades (more would overlap), looked up at draw time. An
    axis so narrow that fewer than :data:`MIN_LOG_LABELS` of those fall on it (1.4 to 6: only a 2 and a 5, a
    std panel that read as two stray labels) gets evenly spaced plain ticks instead."""
    import matplotlib.ticker

    class Ticks(matplotlib.ticker.Locator):
        def __init__(self) -> None:
            self.log = matplotlib.ticker.LogLocator(base=10)
            self.even = matplotlib.ticker.MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10])

        def __call__(self):
            return self.tick_values(*axis.get_view_interval())

        def tick_values(self, vmin, vmax):
            lo, hi = sorted((vmin, vmax))
            if log_labels_in(lo, hi) >= MIN_LOG_LABELS:
                return self.log.tick_values(lo, hi)
            return [t for t in self.even.tick_values(lo, hi) if t > 0]

    axis.set_major_locator(Ticks())
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _log_label(v)))

    def minor(v, _):
        lo, hi = sorted(axis.get_view_interval())
        narrow = lo > 0 and hi / lo < 100 and log_labels_in(lo, hi) >= MIN_LOG_LABELS
        return _log_label(v) if narrow and f"{v:.0e}"[0] in "25" else ""      # the first digit, 0.5 too
    axis.set_minor_formatter(matplotlib.ticker.FuncFormatter(minor))


LABEL_CHARS = 60       # longer text from the data (a case name) is cut in figures: the page names it in full


def short_label(text, limit: int = LABEL_CHARS) -> str:
    """``text`` as a figure shows it: at most ``limit`` characters, a long one cut with an ellipsis, so that
    a 300-character case name leaves room for the panels (matplotlib's layout gives up, or the tick labels
    are cut off at the figure's edge, otherwise)."""
    text = " ".join(str(text).splitlines())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
