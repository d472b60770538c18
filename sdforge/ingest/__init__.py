"""From source files or URLs to WebDataset shards: source adapters, fetching, re-sharding, tar reading."""
