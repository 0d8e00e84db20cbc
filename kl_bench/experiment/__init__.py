"""A spec end to end: parsing (:mod:`.spec`), one case's passes and summary rows (:mod:`.case`), the λ sweep
(:mod:`.lambdas`), gradient rows (:mod:`.gradient_rows`) and group baselines (:mod:`.group_baselines`)."""
