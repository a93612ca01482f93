"""Subcommands of the ``flt`` console script."""
