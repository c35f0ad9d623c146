"""The router <-> worker link, sans-IO: its messages, its websocket frames, what a worker registers."""
