"""jaxtrain: JAX/TPU-first training of large language models."""

__version__ = "0.4.2"
