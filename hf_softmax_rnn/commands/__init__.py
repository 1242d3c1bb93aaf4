"""The subcommands of the `hf-softmax-rnn` console script, one module each (`add_arguments`, `run`); the
computations they run live in the library (`analysis`, `training`, `long_context`, ...)."""
