"""The configuration: defaults, the names of every mode, every rule, old configs' values."""
