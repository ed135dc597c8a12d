"""Evaluations of a trained model: retrieval on the similarity benchmark (``retrieval``), the
scores of a classifier (``classification``), and claims over seeds (``seeds``)."""
