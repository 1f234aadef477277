"""Benchmarks: ``python -m benchmarks NAME [ARGS]`` runs one and writes its markdown section to
``out/bench/`` (``benchmarks/__main__.py``); ``python -m benchmarks.NAME`` prints it alone.

Figures are ratios measured side by side in one run; BENCHMARKS.md has today's.
"""

# Before torch: dynquant sets OpenMP's short spin (dynquant/openmp.py), which libgomp reads when
# torch loads it; with torch's default long spin, its idle threads hold the cores that the
# native kernels' threads need (`benchmarks/demo_under_load.py`).
import dynquant  # noqa: F401
