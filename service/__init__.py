"""The gRPC service (``tandem serve``), the P/D router (``tandem router``),
the CLI and the Prometheus metrics. Depends on ``engine`` and
``connectors``; neither imports it."""
