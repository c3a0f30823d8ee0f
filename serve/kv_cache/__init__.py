"""Paged KV cache: block allocation (pure Python) and, separately, the KV tensors."""
