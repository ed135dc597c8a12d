"""Data preparation: inputs → deduplicated corpus → tokenizer → packed shards."""
