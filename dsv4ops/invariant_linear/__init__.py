"""`dsv4::invariant_linear`: out = x @ weight^T with a schedule fixed independently of the row count,
so every output row's bits depend on that row of x and the weight only (batch-invariant serving,
CacheConfig(batch_invariant=True)). Reference: reference.py; the CUDA kernel: triton.py."""
