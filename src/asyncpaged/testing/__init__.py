"""Helpers for tests: tiny seeded checkpoints of each supported model family."""
