"""shardfs benchmark harness: `python -m bench run --quick --docs docs/benchmarks.md`.

See docs/benchmarks.md for the latest results and bench/run.py for what runs.
"""
