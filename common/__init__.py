"""What the head and the workers both use: telemetry, TLS, logging and the worker token."""
