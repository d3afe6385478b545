"""runtime layer of the pipeline (see DESIGN.md)."""
