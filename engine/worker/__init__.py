"""Model runner, KV-cache tensors, sampler and the persistent input batch."""
