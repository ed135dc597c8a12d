"""The input pipeline: read plan, masking, batches, prefetch, staging, dataset checks."""
