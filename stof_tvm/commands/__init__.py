"""Subcommands of the stof-tvm command line, one module each."""
