"""A trained model (workdir or Hugging Face directory) for the tools."""
