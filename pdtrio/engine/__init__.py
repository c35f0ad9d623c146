"""Engines behind the workers. Importing this package does not import torch."""
