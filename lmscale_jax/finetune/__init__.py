"""Contrastive fine-tuning of a pretrained encoder on pairs of functions."""
