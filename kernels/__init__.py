"""Triton kernels for paged attention and their pure-torch references
(arriving with the model execution issue)."""
