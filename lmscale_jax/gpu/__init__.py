"""The GPU self-check."""
