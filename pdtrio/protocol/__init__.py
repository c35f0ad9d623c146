"""The sans-IO core: pure state machines and values. No trio, httpx, hypercorn or torch.

It imports the standard library (but none of its I/O modules), attrs, msgspec and
wsproto, and nothing else of the package: ``tests/test_layering.py`` states that set.
"""
