"""The pipeline: measure, allocate, quantize, evaluate."""
