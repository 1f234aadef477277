"""What runs a written checkpoint for people: evaluation, generation, the size-quality frontier, the demo."""
