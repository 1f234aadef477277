"""Runtime: packed modules that dequantize on the fly, and loading a checkpoint into a model."""
