"""FX-graph passes (compile path)."""
