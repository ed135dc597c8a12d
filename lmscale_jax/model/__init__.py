"""The models: BERT (MLM), its FLOPs and memory, the Hugging Face mapping, the embedding head."""
