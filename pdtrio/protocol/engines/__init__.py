"""The vLLM and SGLang PD protocols the router speaks to engines it fronts, sans-IO."""
