"""The measure stage: a model's maps document (sensitivities and candidate errors per module)."""
