"""The head side: scheduler, global KV block table, engine loop, frontend, routing and the public Python API."""
