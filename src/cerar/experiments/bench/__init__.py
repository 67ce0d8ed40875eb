"""``cerar bench``: the all-reduce benchmark (config, methods, worker, statistics, report)."""
