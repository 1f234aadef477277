"""The format layer: schema, layout, packing, metadata and checkpoint files. No model code here."""
