"""KV connectors: the API in ``base`` and its implementations."""
