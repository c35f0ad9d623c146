"""The torch engine: model, paged KV cache, loaders, sampler and the engine loop.

Everything under this package imports torch (the ``worker`` extra); nothing
outside it does, so the router and the synthetic engine run without torch.
"""
