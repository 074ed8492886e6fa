"""Tandem's inference engine: scheduler, KV cache, model runner. No networking."""
