"""Plot functions: each takes a DataFrame (and an optional ``ax``) and returns the figure.

Nothing here writes files; the CLI does. A colour is an estimator's, in every figure (kl_bench.present.figstyle: k1
is the same blue whichever estimators a run has); an aggregate (seq, tok, ...) is a line style and a
marker. Where lines can coincide (the ECDFs of k3 and fwd_k3 at small KL), earlier lines are drawn wider,
so that every one stays visible.

Importing this module changes no global state: no backend is selected and neither matplotlib's
rcParams nor seaborn's theme are touched. Each plot function applies the report's look (seaborn's
whitegrid style, notebook context, colorblind colour cycle) through :func:`matplotlib.rc_context`
only while it builds its figure. New figures are :class:`matplotlib.figure.Figure` objects, not
pyplot figures, so they need no GUI backend and pyplot does not keep them open; ``fig.savefig``
renders them with Agg on a headless machine.

The plot functions live by figure family (plots_bias: bias/std and planning; plots_sweep: λ and sweeps;
plots_distribution: distributions and convergence; plots_rollout: rollouts and gradients) and share
kl_bench.present.plot_helpers; this module is their index, where the report's figure registry finds a
plot function by its name (kl_bench.present.report_figures.FigureKind.plot).
"""
from __future__ import annotations

from .plots_bias import plot_bias_std, plot_planning
from .plots_distribution import plot_convergence, plot_distribution
from .plots_rollout import plot_gradient_cosine, plot_rollout_growth
from .plots_sweep import plot_lambda_curve, plot_sweep

__all__ = ["plot_bias_std", "plot_convergence", "plot_distribution", "plot_gradient_cosine", "plot_lambda_curve",
           "plot_planning", "plot_rollout_growth", "plot_sweep"]
