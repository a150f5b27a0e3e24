"""Command-line tools: reports and benchmarks (not imported by the engine)."""
