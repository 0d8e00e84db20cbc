"""The regression gate from a script (:func:`check` → :class:`CheckReport`): exact values and a stored
baseline, Holm's step-down."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..foundation.errors import SpecError
from .inputs import number_argument, path_argument
from .preparation import load
from .result import Result

if TYPE_CHECKING:
    import pandas as pd

    from ..analysis.gate import Comparison


@dataclass
class CheckReport:
    """The regression gate's verdict: ``passed``, the ``failures`` (each with ``.sentence()``), every
    comparison as a ``table``, and notes (rows on one side only, a spec changed since the baseline)."""
    comparisons: list["Comparison"]
    alpha: float
    notes: list[str] = field(default_factory=list)
    baseline: str | None = None

    @property
    def passed(self) -> bool:
        """All comparisons passed, and there was at least one: a gate that compared nothing fails."""
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def failures(self) -> list["Comparison"]:
        return [c for c in self.comparisons if not c.passed]

    @property
    def table(self) -> "pd.DataFrame":
        import pandas as pd
        return pd.DataFrame([{"row": c.row, "statistic": c.statistic, "value": c.value, "reference": c.reference,
                              "se": c.se, "z": c.z, "p": c.p, "z_limit": c.threshold, "passed": c.passed}
                             for c in self.comparisons])

    def to_json(self) -> bytes:
        """The verdict and every comparison, for CI (``kl-bench check --json FILE``). Non-finite numbers
        are written as null (JSON has no NaN or inf)."""
        import json

        def num(x):
            return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
        doc = {"kl_bench_check": 1, "passed": self.passed, "verdict": self.verdict, "alpha": self.alpha,
               "baseline": self.baseline, "notes": list(self.notes),
               "comparisons": [{"row": c.row, "statistic": c.statistic, "value": num(c.value),
                                "reference": num(c.reference), "se": num(c.se), "z": num(c.z), "p": num(c.p),
                                "z_limit": num(c.threshold), "passed": bool(c.passed),
                                **({} if c.passed else {"failure": c.sentence()})} for c in self.comparisons]}
        return (json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode()

    def to_junit(self) -> bytes:
        """JUnit XML (one testcase per comparison, a failure element with its sentence), the format CI
        systems display (``kl-bench check --junit FILE``)."""
        from xml.etree import ElementTree as ET
        suite = ET.Element("testsuite", name="kl-bench check", tests=str(len(self.comparisons)),
                           failures=str(len(self.failures)), errors="0", skipped="0")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="alpha", value=f"{self.alpha:g}")
        ET.SubElement(props, "property", name="baseline", value=self.baseline or "")
        for c in self.comparisons:
            case = ET.SubElement(suite, "testcase", classname=c.row, name=c.statistic)
            if not c.passed:
                ET.SubElement(case, "failure", message=c.sentence(), type="StatisticalRegression")
        if self.notes:
            ET.SubElement(suite, "system-out").text = "\n".join(self.notes)
        ET.indent(suite)
        return ET.tostring(suite, encoding="utf-8", xml_declaration=True) + b"\n"

    @property
    def verdict(self) -> str:
        n, bad = len(self.comparisons), len(self.failures)
        if n == 0:
            return ("check: FAILED: nothing was compared (no row has an exact value or a baseline row to compare "
                    "with), so nothing was verified" + (f"; baseline {self.baseline}" if self.baseline else ""))
        from ..foundation.formatting import plural
        return (f"check: {n - bad:,} passed, {bad:,} failed ({plural(n, 'comparison')} against exact values"
                + (f" and baseline {self.baseline}" if self.baseline else "") + f"; family-wise α = {self.alpha:g}, Holm)")


def check(results, baseline=None, alpha: float = 0.001, *, spec=None, spec_sha256: str | None = None) -> CheckReport:
    """Compare every statistic with its exact value and, given a ``baseline`` (a path to a baseline
    JSON, or its decoded dict), with the stored run; Holm's step-down at family-wise ``alpha``.

    ``results``: a :class:`Result` (of a live run, or read back by :func:`load_results`), a results folder's
    path, or a summary DataFrame. The spec's sha256 for the note when the spec changed since the baseline
    is the one the results record (run.json's ``spec_sha256``, a Result's ``envelope``); ``spec_sha256``
    is used where there is no such record (a DataFrame).

    ``spec`` (a path, Spec or dict): the results must be that experiment's, with exactly its cases and a
    spec that differs at most in run settings (kl_bench.results.verify.check_results_match_spec), checked
    alike for a Result and a folder. A summary DataFrame holds no record of the experiment or the spec that
    made it, so ``spec`` with a DataFrame is refused in one line (pass the Result or its folder instead)
    rather than passed without a check."""
    from ..analysis.gate import baseline_comparisons, exact_comparisons, holm, skipped_notes
    from ..results.baseline import load_baseline, normalize_baseline
    if not 0 < number_argument(alpha, "alpha") < 1:
        raise SpecError(f"must lie in (0, 1), got {alpha}", key="alpha")
    if spec_sha256 is not None and not isinstance(spec_sha256, str):
        raise SpecError(f"must be a string (a spec's sha256) or None, got {type(spec_sha256).__name__}",
                        key="spec_sha256")
    df, sha = _checked_summary(results, spec, spec_sha256)
    comparisons = exact_comparisons(df)
    notes: list[str] = skipped_notes(df)        # rows neither passed nor failed: said, not silent
    where = None
    if baseline is not None:
        if isinstance(baseline, dict):
            base, where = normalize_baseline(baseline), "(given)"
        else:
            base, where = load_baseline(path_argument(baseline, "baseline", "a baseline JSON's path or its "
                                                      "decoded dict")), str(baseline)
        if sha is not None and base.get("spec_sha256") != sha:
            notes.insert(0, f"the spec changed since the baseline {where} was made (sha256 "
                         f"{str(base.get('spec_sha256'))[:12]}… then, {sha[:12]}… now); rows are matched by case, "
                         "estimator, aggregate and λ")
        more, row_notes = baseline_comparisons(df, base)
        comparisons += more
        notes += row_notes
    holm(comparisons, alpha)
    return CheckReport(comparisons, alpha, notes, where)


def _checked_summary(results, spec, spec_sha256: str | None) -> tuple["pd.DataFrame", str | None]:
    """:func:`check`'s (summary, spec sha256) of ``results`` (a Result, a folder's path or a DataFrame),
    after checking the results against ``spec`` where they record what made them (a Result and a folder
    alike); ``spec`` with a DataFrame is refused (:func:`check`'s docstring)."""
    import pandas as pd
    if isinstance(results, pd.DataFrame):
        if spec is not None:
            raise SpecError("a summary DataFrame holds no record of the experiment or spec that made it, so it "
                            "cannot be checked against spec=: pass its Result or results folder, or leave spec= "
                            "out", key="spec")
        return results, spec_sha256
    if isinstance(results, Result):
        where = results.path if results.path is not None else "the Result (not written)"
        held = SimpleNamespace(path=where, envelope=results.envelope, summary=results.summary)
    else:
        from ..present.report_data import load_results
        held = load_results(path_argument(results, "results", "a Result, a summary DataFrame or a results "
                                                          "folder's path"))
    if spec is not None:
        from ..results.verify import check_results_match_spec
        check_results_match_spec(held, load(spec))
    recorded = held.envelope.get("spec_sha256")
    return held.summary, recorded if isinstance(recorded, str) else spec_sha256
