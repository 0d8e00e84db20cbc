"""The ground floor: errors, registries, typed TOML tables, safe file I/O, atomic storage, signals, the
one number formatter, progress lines, threads and the version. Imports nothing else of kl_bench."""
