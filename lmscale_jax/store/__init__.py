"""The dataset directory on disk: its format, random access to its records, tokenizers."""
