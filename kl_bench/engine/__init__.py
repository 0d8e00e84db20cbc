"""The engine: seeded batches and their feature sums (:mod:`.monte_carlo`) and torchrun ranks
(:mod:`.distributed`)."""
