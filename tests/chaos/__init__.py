"""Chaos tests: the soak (``python -m tests.chaos.soak``) and its in-suite run."""
