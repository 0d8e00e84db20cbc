"""The one number formatter of the terminal, the advice and the report: significant digits, inf shown,
missing values blank, rounding noise shown as 0; and the one vocabulary of units and words every output
uses (docs/results.md#units-and-words):

- relative bias: ``bias/true`` in percent (:func:`pct`: +1.2%, +6.0%, −0.031%, +2860%);
- spread: ``std/true``, a plain ratio (:func:`fmt`: 1.51, 2.00, 38.4), never "stdev/true"; every number keeps
  its significant digits (2.00, not 2; +6.0%, not +6%), and an exact 0 is "0", never "+0";
- batch sizes (``n ±10%``): a whole number with thousands separators (:func:`count`: 872, 1,439,
  2,100,000); ``never`` where the bias alone exceeds the tolerance; :data:`UNKNOWN` ("—") where no exact
  bias is known;
- counts of things: :func:`plural` ("1 figure", "2 figures", "1 step");
- a measured value, its SE and the exact value beside it: :func:`measured_cells`, the one digit rule of
  every output (the value to its SE's precision, the exact value to as many digits);
- other numbers of the paper table and the report: :func:`sig` (3 significant digits, "—" where missing);
- sizes and big integers in messages: :func:`fmt_bytes` (1.5 GiB), :func:`fmt_count` (digits, or
  9.22e+18 beyond 10^15).
"""
from __future__ import annotations

import math
import re
from decimal import Decimal

# Two different exact float64 sums (or a sum and a closed form) agree to ~1e-15 relative; differences
# below this fraction of the compared quantity's scale are rounding, not statistics (kl_bench.core.stats uses
# it as the z scores' floor; here a difference below it prints as 0, not as "+6.51e-17").
ROUNDING = 1e-12

CV, CV_OPT = "cv", "cv_opt"    # names of the control-variate rows (kl_bench.core.estimators.make_cv makes them)
UNKNOWN = "—"          # a number that no exact value supports (n ±10% without an exact bias)
NEVER = "never"        # a batch size that does not exist (the bias alone exceeds the tolerance)


def exponent(text: str) -> str:
    """A number's power of ten as every output writes it: "e-5", "e3" (not Python's "e-05", "e+03")."""
    return re.sub(r"e([+-]?)0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), text)


def num(x) -> float:
    """A cell as a float (NaN for blanks, text or None): numpy and int values alike."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _special(x: float, sign: bool) -> str | None:
    """How a missing (blank) or infinite value prints, None for the others."""
    if _missing(x):
        return ""
    if math.isinf(x):
        return ("+inf" if sign else "inf") if x > 0 else "-inf"
    return None


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def below_floor(x: float, scale: float | None) -> bool:
    """Whether ``x`` is rounding at ``scale``: |x| ≤ ROUNDING·|scale| (a finite x and scale only)."""
    return scale is not None and math.isfinite(x) and math.isfinite(scale) and abs(x) <= ROUNDING * abs(scale)


def fmt(x: float, digits: int = 3, scale: float | None = None, sign: bool = False) -> str:
    """Significant-digit formatting that shows inf and leaves missing values blank. ``scale``: the size
    of the quantities ``x`` was computed from (a difference of two KLs: the KL); |x| at or below
    ROUNDING·|scale| is float64 rounding and prints as 0. ``sign``: a leading + on positive values."""
    special = _special(x, sign)
    if special is not None:
        return special
    if x == 0 or below_floor(x, scale):
        return "0"
    s = "+" if sign else ""
    if 1e-3 <= abs(x) < 1e5:
        return _kept(f"{x:{s}#.{digits}g}") if abs(x) < 10 ** digits else f"{x:{s}.0f}"
    return exponent(f"{x:{s}.{digits - 1}e}")


def _kept(text: str) -> str:
    """Python's "#g" (trailing zeros kept: 1.50, 6.0, as many significant digits on every number of a column),
    without the bare point it leaves on a whole number ("150." → "150")."""
    return text[:-1] if text.endswith(".") else text


def pct(x: float, sign: bool = True) -> str:
    """A ratio as a percentage with two significant digits (+1.2%, −0.031%, +2860%); |x| < 1e-9 is float64
    rounding of two exact sums, shown as 0; NaN blank."""
    special = _special(x, sign)
    if special is not None:
        return special
    if abs(x) < 1e-9:
        return "0"
    v = 100 * x
    s = "+" if sign else ""
    if abs(v) >= 99.5:          # 99.96% rounds to 100 at two digits: whole percents from there ("+100%")
        return f"{v:{s}.0f}%"
    return exponent(_kept(f"{v:{s}#.2g}")) + "%"


def count(n: float) -> str:
    """A batch size or a number of draws, whole, with thousands separators: 872, 1,439, 2,100,000;
    :data:`NEVER` for inf (no batch size gets there); blank for NaN."""
    if _missing(n):
        return ""
    if math.isinf(n):
        return NEVER
    return f"{n:,.0f}"


def plural(n: float, word: str, words: str | None = None) -> str:
    """"1 figure", "2 figures", "1,000 steps": a count and its noun (``words``: an irregular plural)."""
    return f"{count(n)} {word if n == 1 else (words or word + 's')}"


def sig(x: float, digits: int = 3) -> str:
    """Significant digits as the paper table shows them; 0 for float64 rounding of exact zeros."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if abs(x) < 1e-9:
        return "0"
    return exponent(_kept(f"{x:#.{digits}g}"))


def fmt_bytes(n: float) -> str:
    """A size for a message: 3 significant digits in the largest binary unit it reaches (exact: Decimal)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{Decimal(n) / size:.3g} {unit}"
    return f"{int(n)} B"


def fmt_count(n: int) -> str:
    """An integer for a message: digits when short, else scientific (2^63 − 1 → 9.22e+18; 10^400 too,
    beyond float64's range)."""
    return f"{n:,}" if abs(n) < 10**15 else f"{Decimal(n):.3g}"


# ----------------------------------------------------------------------------- measured ± SE next to exact
MAX_DIGITS = 10     # significant digits a measured value shows at most (an SE far below the value's own size)
SE_DIGITS = 2       # significant digits of an SE


def _quantum(se: float, value: float) -> int:
    """The decimal exponent q of the last digit a measured value shows: the SE's second significant digit
    (after the SE's own rounding: 9.96e-5 rounds to 1.0e-4, so q = −5), never finer than MAX_DIGITS
    significant digits of the value; without a usable SE (0, NaN, inf), 4 significant digits of the value."""
    size = abs(value) if math.isfinite(value) and value else 0.0
    floor = math.floor(math.log10(size)) - MAX_DIGITS + 1 if size else -99
    if math.isfinite(se) and se > 0:
        return max(int(f"{se:.{SE_DIGITS - 1}e}".split("e")[1]) - SE_DIGITS + 1, floor)
    return math.floor(math.log10(size)) - 3 if size else 0


def _at(x: float, q: int, exp: int, sign: bool) -> str:
    """``x`` rounded to 10^q, written in units of 10^exp (exp = 0: plain decimals; else "…e-5")."""
    special = _special(x, sign)
    if special is not None:
        return special
    if x == 0:
        return "0"
    text = f"{Decimal(repr(x)).scaleb(-exp):{'+' if sign else ''}.{max(exp - q, 0)}f}"
    if text.lstrip("+-").strip("0.") == "":         # rounds to zero at this precision: no "-0.000"
        text = text.lstrip("+-")
    return text + (f"e{exp}" if exp else "")


def _shared_power(value: float, exact: float, se: float) -> int:
    """The power of ten measured cells share: 0 (plain decimals) unless the largest finite one is below 10^-3 or
    reaches 10^5. The SE counts too: a value far below its SE (+6e-4% ± 0.33%) prints in the SE's notation."""
    size = max((abs(x) for x in (value, exact, se) if math.isfinite(x)), default=0.0)
    return math.floor(math.log10(size)) if size and (size < 1e-3 or size >= 1e5) else 0


def measured_cells(value: float, se: float = math.nan, exact: float = math.nan, *, sign: bool = False,
                   unit: str = "") -> tuple[str, str, str]:
    """The one digit rule of every output: (measured value, its SE, the exact value beside it) as text, the
    measured value to the SE's precision (the SE to SE_DIGITS significant digits, the value to the same
    decimal place), the exact value to the same place, all three in one notation (plain decimals, or a shared
    power of ten "…e-5" where the largest of value, exact and SE is below 10^-3 or reaches 10^5, as :func:`fmt`), so that
    (value − exact) / SE read off the cells is the row's z within rounding. An exact 0 prints as "0"
    (without ``unit``); missing values are blank. ``sign``: a + on positive values (a bias); ``unit``: appended to each ("%")."""
    value, se, exact = (float(x) if x is not None else math.nan for x in (value, se, exact))
    q = _quantum(se, value if math.isfinite(value) else exact)
    exp = _shared_power(value, exact, se)
    if exp:
        q = min(q, exp)     # at least the shared power's own digit
    cells = (_at(value, q, exp, sign), _at(se, q, exp, False) if math.isfinite(se) else "",
             _at(exact, q, exp, sign))
    return tuple(c + unit if c and c[-1].isdigit() and c != "0" else c for c in cells)
