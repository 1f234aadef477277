"""Where the pipeline's work runs, how long work reports progress, and memory handed back."""
