"""models layer of the pipeline (see DESIGN.md)."""
