"""The package's version, `hf_softmax_rnn.__version__` (in its own module, so that modules the package
root imports can name it without importing the root)."""

__version__ = "0.1.0"
