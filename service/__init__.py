"""The gRPC service, P/D router, CLI and metrics (arriving with the service
issue). Depends on ``engine``; ``engine`` never imports it."""
