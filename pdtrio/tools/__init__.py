"""Command-line tools beside the router and the workers (run with ``python -m``)."""
