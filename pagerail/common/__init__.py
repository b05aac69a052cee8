"""What the head and the workers both use: telemetry, TLS, logging, the worker token and heap tuning."""
