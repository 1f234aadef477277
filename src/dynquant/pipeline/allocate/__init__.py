"""Widths from sensitivities: the maps document, the allocation at a budget, its forecast."""
