"""Per-request KV state: the buffer layout, the worker-side store."""
