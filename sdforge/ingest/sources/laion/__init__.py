"""The LAION kind: metadata rows are URLs, filtered by quality thresholds and de-duplicated, then fetched."""
