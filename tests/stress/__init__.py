"""Long-running fuzz tests (crash_fuzz.py) and the instrumented training entry point they kill (fuzz_child.py)."""
