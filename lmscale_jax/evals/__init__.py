"""Evaluations of a trained model: retrieval on the similarity benchmark."""
