"""`pdserve bench-kv`: how fast a KV cache moves between two processes through the real path."""
