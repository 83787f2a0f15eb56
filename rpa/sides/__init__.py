"""The two engines the numerics are put into: vLLM (plugin, engine) and transformers (patch, loading)."""
