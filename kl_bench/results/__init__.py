"""Everything kl-bench stores, in one place: the tables' schemas (:mod:`.schema`, a comment per column),
the one CSV writer and reader (:mod:`.frames`), and reading a results folder back with every file checked
(:mod:`.verify`: sha256 against run.json, columns, numbers, cases), older folders brought to today's
format when read (:mod:`.migrate`), the gate's baselines (:mod:`.baseline`) and the checkpoints of an
interrupted run (:mod:`.checkpoint`). The rows themselves are made above the engine (:mod:`kl_bench.experiment.rows`);
importing this package (to read, report or gate results) loads neither the engine nor any case kind.
"""
from .frames import frame_to_csv_bytes, read_frame, to_frame
from .schema import (BATCH_SCHEMA, COLUMNS, EXACT_COLUMNS, GRAD_SCHEMA, MEASURED, SCHEMA, SWEEP_PREFIX,
                     SWEEP_SCHEMA, TEXT_COLUMNS)

__all__ = ["BATCH_SCHEMA", "COLUMNS", "EXACT_COLUMNS", "GRAD_SCHEMA", "MEASURED", "SCHEMA", "SWEEP_PREFIX",
           "SWEEP_SCHEMA", "TEXT_COLUMNS", "frame_to_csv_bytes", "read_frame", "to_frame"]
