"""Isolated compile/run/benchmark of untrusted programs. Placeholder until its own issue (#3)."""
