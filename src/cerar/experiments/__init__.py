"""The experiments (bench, train, study) and what they share: config flags, optional extras."""
