"""The test suite's package."""
