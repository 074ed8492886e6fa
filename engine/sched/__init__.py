"""The scheduler (vLLM v1's algorithm) and its inputs/outputs. No torch."""
