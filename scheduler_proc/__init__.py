"""The scheduler process: request state, KV block pool, batching policy and the step loop.

Imports no torch, so it starts fast and its hot loop is plain Python plus msgspec.
"""
