"""The maths of CERAR, numpy/scipy only: codes, constructions, decoders, error analysis, designs."""
