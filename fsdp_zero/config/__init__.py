"""What a run is: the schema, the strategy table, the loader and the DeepSpeed reader (torch-free)."""
