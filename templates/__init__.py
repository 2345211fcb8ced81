"""Prompt templates shipped as package data (Jinja, deterministic: no clocks, ids or sets).

Loaded by ``agentcache.prompt._templates`` through ``importlib.resources``; this package holds no
code, only the ``*.jinja`` files beside this one.
"""
