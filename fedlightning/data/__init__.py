"""Raw files -> typed graphs and event streams; client partitions; protocol objects."""
