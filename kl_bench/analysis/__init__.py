"""What results mean: the regression gate and the advice (what to log, what to put in the loss). Reads
tables; loads no engine, case kind or sampler."""
