"""Worker processes: pull requests from Redis streams as far as free KV blocks
allow, run them through the engine, record results exactly once."""
