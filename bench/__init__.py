"""needle's benchmark: throughput against the machine's measured limit and against Needle.

Run from the repository root (see docs/benchmark.md for every key of the JSON it writes):

    python -m bench.run [--quick] [--skip-cactus] [--out bench/results/latest.json]
"""
