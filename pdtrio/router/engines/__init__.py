"""The vLLM and SGLang backend: the engine pool and the engines' HTTP legs."""
