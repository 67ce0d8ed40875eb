"""Running ranks: the launcher, one rank's start and stop, progress lines, the emulated network."""
