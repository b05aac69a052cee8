"""The front doors: OpenAI-compatible HTTP, the public gRPC API, tokenization and detokenization."""
