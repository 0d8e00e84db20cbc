"""The maths: estimators, targets, clamps and presets, gradient modes, weight corrections, rejection masks,
aggregates, exact oracles and statistics. Tensors in, tensors out: no files, no case kind."""
