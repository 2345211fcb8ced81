"""Sampling: frozen params, the batched sampler, grammars (xgrammar) and Hermes tool-call grammars.
Sees one logits row per request and its params; never sees the batch's KV, the radix tree or the
scheduler."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.sampling.grammar import (
        GrammarCompiler,
        GrammarError,
        GrammarMatcher,
        GrammarSpec,
        JsonSchemaSpec,
        StructuralTagSpec,
    )
    from runtime.sampling.params import SamplingParams
    from runtime.sampling.sampler import LogitsProcessor, TokenCounts, sample_batch
    from runtime.sampling.tool_grammar import no_tool_call_spec, tool_call_spec

# NOTE: lazy, so importing the package loads none of its heavy submodules (torch).
_LAZY = {
    "GrammarCompiler": "runtime.sampling.grammar",
    "GrammarError": "runtime.sampling.grammar",
    "GrammarMatcher": "runtime.sampling.grammar",
    "GrammarSpec": "runtime.sampling.grammar",
    "JsonSchemaSpec": "runtime.sampling.grammar",
    "LogitsProcessor": "runtime.sampling.sampler",
    "SamplingParams": "runtime.sampling.params",
    "StructuralTagSpec": "runtime.sampling.grammar",
    "TokenCounts": "runtime.sampling.sampler",
    "no_tool_call_spec": "runtime.sampling.tool_grammar",
    "sample_batch": "runtime.sampling.sampler",
    "tool_call_spec": "runtime.sampling.tool_grammar",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.sampling' has no attribute {name!r}")


__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "JsonSchemaSpec",
    "LogitsProcessor",
    "SamplingParams",
    "StructuralTagSpec",
    "TokenCounts",
    "no_tool_call_spec",
    "sample_batch",
    "tool_call_spec",
]
