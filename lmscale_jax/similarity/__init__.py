"""The binary-code similarity data: benchmark and pairs files, their sources, leakage."""
