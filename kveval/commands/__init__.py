"""The ``kveval`` command line: one module per subcommand, the only layer that parses arguments."""
