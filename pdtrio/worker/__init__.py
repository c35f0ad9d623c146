"""The worker process: engine, KV transfer and the control API, on trio."""
