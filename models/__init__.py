"""Model architectures (targets and drafters) and weight loading."""
