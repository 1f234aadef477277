"""Calibration: the text, the streamed passes over the model, the statistics and sensitivities they give."""
