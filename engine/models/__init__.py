"""Model definitions (Llama family) and weight loading."""
