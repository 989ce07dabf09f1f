"""Benchmarks: ``python -m bench --help``. Results and the commands that produced them: ``bench/RESULTS.md``."""
