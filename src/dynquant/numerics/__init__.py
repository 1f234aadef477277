"""Numerics: the group-wise asymmetric quantizer and its error measures."""
