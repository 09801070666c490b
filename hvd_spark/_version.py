"""The package's version, in a leaf module: ``hvdrun --version`` reads it without the root."""

__version__ = "0.1.0"
