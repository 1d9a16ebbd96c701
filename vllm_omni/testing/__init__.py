"""Helpers for tests, benchmarks and the built-in tiny defaults (no downloads, ever)."""
