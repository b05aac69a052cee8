"""The engine core: block table, scheduler, requests, step messages and the engine loop (no torch, Ray or gRPC)."""
