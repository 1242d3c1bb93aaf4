"""Subcommands of the `hf-softmax-rnn` console script that are not part of a subpackage."""
