"""The transport layer: who talks to whom, how the rounds are pipelined, how ranks agree on a call."""
