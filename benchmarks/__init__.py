"""Benchmarks: each runnable alone (``python -m benchmarks.NAME``), one line per figure.

Figures are ratios measured side by side in one run; results are recorded in BENCHMARKS.md.
"""

# Before torch: dynquant sets OpenMP's short spin (dynquant/openmp.py), which libgomp reads when
# torch loads it; with torch's default long spin, its idle threads hold the cores that the
# native kernels' threads need (the seed decode step: 91 -> 68 ms with it).
import dynquant  # noqa: F401
