"""The prefix-cache algorithm on its own: radix tree over token ids, block pool, and their join.

It knows block ids, token ids and KV tensors, never models, requests, sampling, threads or HTTP.
"""

__all__: list[str] = []
