"""The KV cache's block bookkeeping: synchronous, pure Python, no torch (the block allocator actor
wraps it)."""
