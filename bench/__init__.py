"""gpugate's benchmarks: `python3 bench/run.py [--quick]` (see CONTRIBUTING.md, Benchmarks)."""
