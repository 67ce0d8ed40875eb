"""The ring schedule as data and the single-process simulators (numpy only)."""
