"""Models: the reference hybrid architecture, presets, and reading model sources."""
