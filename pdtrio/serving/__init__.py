"""``pdtrio serve``: the router as an operator runs it (see ``cli``; docs/operating.md)."""

from pdtrio.serving.cli import argument_parser, main

__all__ = ["argument_parser", "main"]
