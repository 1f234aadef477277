"""Benchmarks: each runnable alone (``python -m benchmarks.NAME``), one line per figure.

Figures are ratios measured side by side in one run; results are recorded in BENCHMARKS.md.
"""
