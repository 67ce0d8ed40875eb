"""CERAR's per-rank run: its encode and decode, the matrices they read, the packet scale."""
