"""A spec end to end: parsing (:mod:`.spec`; its ``[experiment]`` table in :mod:`.spec_experiment`, ``[[sweep]]`` tables in
:mod:`.sweeps`), one case's passes and summary rows (:mod:`.case`), the λ sweep
(:mod:`.lambdas`), gradient rows (:mod:`.gradient_rows`) and group baselines (:mod:`.group_baselines`)."""
