"""needle: fine-tune small tool-calling language models in JAX."""

__version__ = "0.1.0"
