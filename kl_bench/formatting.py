"""The one number formatter of the terminal, the advice and the report: significant digits, inf shown,
missing values blank."""
from __future__ import annotations

import math


def fmt(x: float, digits: int = 3) -> str:
    """Significant-digit formatting that shows inf and leaves missing values blank."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return f"{x:.{digits - 1}e}"


def fmt_rel(x: float) -> str:
    """A relative bias; |x| < 1e-9 is float64 rounding of two exact sums, shown as 0."""
    if isinstance(x, float) and math.isfinite(x) and abs(x) < 1e-9:
        return "0"
    return fmt(x)


def pct(x: float, sign: bool = True) -> str:
    """A ratio as a percentage with two significant digits (+1.2%, −0.031%, +2860%); |x| < 1e-9 is float64
    rounding of two exact sums, shown as 0; NaN blank."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if math.isinf(x):
        return ("+" if sign else "") + "inf" if x > 0 else "-inf"
    if abs(x) < 1e-9:
        return "0"
    v = 100 * x
    s = "+" if sign else ""
    return f"{v:{s}.0f}%" if abs(v) >= 100 else f"{v:{s}.2g}%"


def count(n: float) -> str:
    """A batch size or a number of draws: 872, 1,439, 2.1e+05 from a million on, 'never' for inf."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    if math.isinf(n):
        return "never"
    return f"{n:,.0f}" if n < 1e6 else f"{n:.1e}"


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 figure', '2 figures', '1,000 steps': a count and its noun ("" + s unless ``words`` is given)."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"
