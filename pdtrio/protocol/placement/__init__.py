"""Where a request goes, sans-IO: scheduling policies and the prefix indexes that feed them."""
