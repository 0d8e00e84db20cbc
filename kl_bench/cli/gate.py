"""``kl-bench check`` (the statistical regression gate) and ``kl-bench baseline`` (what it compares with)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..foundation.errors import SpecError
from .common import (DEFAULT_RUNS, Command, app, check_output, float_flag, out_console,
                     user_errors, write_outputs)
from .common import device_option, draws_option, quiet_option, seed_option

BASELINES = Path("results") / "baselines"        # committed: the gate's default reference
# Where `kl-bench baseline` writes without --out: git-ignored, so that making a baseline never replaces the
# committed reference unless asked (--out results/baselines/<name>.json).
NEW_BASELINES = DEFAULT_RUNS / "baselines"


def refuse_run_options(results: Optional[Path], **given) -> None:
    """With --results the numbers are read, not drawn: a run's option (--draws, --seed, --device) given too
    would change nothing, and the baseline would record what it did not do. One line, exit 2, before any work."""
    names = [f"--{name}" for name, value in given.items() if value is not None]
    if results is None or not names:
        return
    said = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    raise SpecError(f"{said} {'has' if len(names) == 1 else 'have'} no effect with --results (the numbers are read "
                    f"from {results}, as its run drew them): drop {'it' if len(names) == 1 else 'them'}, or run the "
                    "spec without --results")


def summary_for(spec_path: Path, results: Optional[Path], draws, seed, device, quiet: bool):
    """(spec, summary DataFrame, run): from --results DIR (verified against the spec; ``run``: its run.json,
    whose seed and spec sha256 are those of the numbers), or by running the spec (``run``: None)."""
    from ..api import load, load_results, run
    with user_errors():                 # run options with --results: refused by the callers, before any work
        sp = load(spec_path, draws=draws, seed=seed, device=device)
        if results is not None:
            res = load_results(results)
            from ..results.verify import check_results_match_spec
            check_results_match_spec(res, sp)          # another experiment's folder: one line, exit 2
            if res.envelope.get("spec_sha256") != sp.sha256:
                from ..present.terminal import prose
                prose(out_console, f"note: {results} was produced by a different version of {spec_path} "
                      f"(spec sha256 {str(res.envelope.get('spec_sha256'))[:12]}… vs {sp.sha256[:12]}…)")
            return sp, res.summary, res.envelope
        result = run(sp, progress=not quiet)
    return sp, result.summary, None


@app.command(cls=Command)
def check(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
          baseline: Optional[Path] = typer.Option(None, "--baseline", help="baseline JSON [default: "
                                                  "results/baselines/<name>.json when it exists]"),
          results: Optional[Path] = typer.Option(None, "--results", help="check this results folder instead of running"),
          alpha: float = typer.Option(0.001, "--alpha", parser=float_flag, help="family-wise error rate (Holm)"),
          seed: Optional[int] = seed_option(),
          draws: Optional[str] = draws_option(),
          device: Optional[str] = device_option(),
          quiet: bool = quiet_option("print only failures and the verdict"),
          json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE",
                                                  help="also write the verdict and every comparison as JSON"),
          junit: Optional[Path] = typer.Option(None, "--junit", metavar="FILE",
                                               help="also write JUnit XML (one testcase per comparison)")) -> None:
    """Statistical regression gate: every statistic against its exact value and a stored baseline.
    Exit 0 when all pass, 1 when any fails, 2 for bad input."""
    from .. import api
    with user_errors():
        if not 0 < alpha < 1:
            raise SpecError(f"must lie in (0, 1), got {alpha}", key="--alpha")
        refuse_run_options(results, draws=draws, seed=seed, device=device)
        base_path, use_base = _gate_inputs(spec, baseline, results, json_out, junit)
    sp, df, run = summary_for(spec, results, draws, seed, device, quiet=quiet)
    with user_errors():
        rep = api.check(df, base_path if use_base else None, alpha,
                        spec_sha256=sp.sha256 if run is None else run.get("spec_sha256"))
    from ..present.run_tables import CHECK_LAYOUT, check_table
    from ..present.terminal import prose, show
    if not quiet:
        show(out_console, check_table(rep), **CHECK_LAYOUT)
    for note in rep.notes:
        prose(out_console, f"note: {note}")
    for c in rep.failures:
        prose(out_console, f"FAIL {c.sentence()}")
    prose(out_console, rep.verdict)
    write_outputs({json_out: rep.to_json, junit: rep.to_junit})
    if not rep.passed:
        raise typer.Exit(1)


def _gate_inputs(spec: Path, baseline: Optional[Path], results: Optional[Path], json_out: Optional[Path],
                 junit: Optional[Path]) -> tuple[Path, bool]:
    """The check's baseline (given, or the committed one when it exists) and whether there is one, after
    refusing, before any sampling: reports that would replace a file the check reads (the default baseline
    included) or each other, and a broken baseline or another experiment's."""
    from .. import api
    from ..foundation.output_paths import same_path
    sp0 = api.load(spec)
    base_path = baseline or BASELINES / f"{sp0.experiment.name}.json"
    use_base = baseline is not None or base_path.exists()
    for path, key in ((json_out, "--json"), (junit, "--junit")):
        if path is not None:
            check_output(path, key, sp0, [(base_path if use_base else None, "the baseline")])
    if json_out is not None and junit is not None and same_path(json_out, junit):
        raise SpecError("names the --json file too: the two reports need two files", file=str(junit), key="--junit")
    if use_base:
        from ..results.baseline import check_baseline_matches, load_baseline
        check_baseline_matches(load_baseline(base_path), sp0.experiment.name, base_path)
    return base_path, use_base


@app.command(cls=Command)
def baseline(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
             out: Optional[Path] = typer.Option(None, "--out", metavar="FILE",
                                                help="baseline JSON [default: runs/baselines/<name>.json; the "
                                                "gate's reference is results/baselines/<name>.json]"),
             results: Optional[Path] = typer.Option(None, "--results", metavar="DIR",
                                                    help="take the numbers from this results folder"),
             draws: Optional[str] = draws_option("override the draws of every case"),
             seed: Optional[int] = seed_option(),
             device: Optional[str] = device_option(),
             quiet: bool = quiet_option("no progress bar")) -> None:
    """Run SPEC (or read --results) and store its statistics as a versioned JSON baseline (by default in
    runs/baselines/, never over the committed reference the gate reads unless --out names it)."""
    from .. import api
    from ..results.baseline import baseline_bytes, make_baseline
    with user_errors():
        refuse_run_options(results, draws=draws, seed=seed, device=device)
        sp0 = api.load(spec)
        target = out or NEW_BASELINES / f"{sp0.experiment.name}.json"
        check_output(target, "--out", sp0, baseline_ok=True)
    sp, df, run = summary_for(spec, results, draws, seed, device, quiet=quiet)
    with user_errors():
        data = baseline_bytes(make_baseline(df, sp, run=run))
    write_outputs({target: lambda: data})
    if not quiet:
        out_console.print(f"baseline of {len(df)} rows → {target}", markup=False)
        reference = BASELINES / f"{sp.experiment.name}.json"
        if out is None:
            out_console.print(f"the gate reads {reference}: check against this one with --baseline {target}, "
                              f"or make it the reference with --out {reference}", markup=False)
