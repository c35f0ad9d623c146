"""pdtrio: prefill/decode disaggregated LLM serving on Trio."""

__version__ = "0.1.0"
