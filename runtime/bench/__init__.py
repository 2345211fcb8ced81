"""Benchmarks behind ``agentcache bench prefix|trace|load``: scripts that print same-run ratios.

Never imported by the engine or the server; never timed tests.
"""

__all__: list[str] = []
