"""What a reader sees: terminal tables, figures (one style for every figure), report pages, and the run,
training and audit reports."""
