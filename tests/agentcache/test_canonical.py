"""Canonical JSON: equal logical values give equal bytes; unsupported values fail by path."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import json
import random
import unicodedata
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agentcache import PromptBuilder
from agentcache.canonical import (
    MAX_DEPTH,
    canonical_json,
    normalize_text,
    stable_hash,
    to_canonical,
)
from agentcache.exceptions import CanonicalizationError, PromptError

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4),
    max_leaves=20,
)


def _shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@settings(max_examples=60, deadline=None)
@given(json_values, st.integers(0, 2**32))
def test_key_order_never_changes_the_bytes(value: Any, seed: int) -> None:
    assert canonical_json(_shuffled(value, random.Random(seed))) == canonical_json(value)


@settings(max_examples=60, deadline=None)
@given(json_values)
def test_canonical_json_round_trips_to_an_equal_value(value: Any) -> None:
    assert json.loads(canonical_json(value)) == to_canonical(value)


def test_fixed_separators_and_sorted_keys() -> None:
    assert canonical_json({"b": [1, 2], "a": {"d": None, "c": True}}) == (
        '{"a":{"c":true,"d":null},"b":[1,2]}'
    )


def test_numbers_render_one_way() -> None:
    assert canonical_json([1.0, -0.0, 2.5, Decimal("3.00"), Decimal("0.1"), 10**20]) == (
        "[1,0,2.5,3,0.1,100000000000000000000]"
    )


def test_unicode_forms_are_normalized() -> None:
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert composed != decomposed
    assert canonical_json({decomposed: decomposed}) == canonical_json({composed: composed})
    assert unicodedata.is_normalized("NFC", canonical_json(decomposed))


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    y: int
    x: int


class Query(BaseModel):
    text: str
    k: int = 3


def test_rich_python_values() -> None:
    value = {
        "when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "id": uuid.UUID(int=1),
        "color": Color.RED,
        "tags": {"b", "a"},
        "pair": (1, 2),
        "point": Point(y=2, x=1),
        "query": Query(text="hi"),
    }
    assert json.loads(canonical_json(value)) == {
        "when": "2026-01-02T03:04:05+00:00",
        "id": "00000000-0000-0000-0000-000000000001",
        "color": "red",
        "tags": ["a", "b"],
        "pair": [1, 2],
        "point": {"x": 1, "y": 2},
        "query": {"k": 3, "text": "hi"},
    }


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": [1, object()]}, "$.a[1]"),
        ({"x": float("nan")}, "$.x"),
        ({(1, 2): "tuple key"}, "$"),
        ({"b": b"bytes"}, "$.b"),
        ({1: "a", "1": "b"}, "$"),
        ({"t": ["ok", "a\ud800"]}, "$.t[1]"),  # lone surrogate: was a UnicodeEncodeError
        ({"\udc00": 1}, "$"),
    ],
)
def test_unsupported_values_name_their_path(value: Any, path: str) -> None:
    with pytest.raises(CanonicalizationError, match=path.replace("$", r"\$").replace("[", r"\[")):
        canonical_json(value)


def test_normalize_text() -> None:
    assert normalize_text("a  \r\nb\t\n\n") == "a\nb"
    assert normalize_text("cafe\u0301") == "caf\u00e9"


def test_a_lone_surrogate_in_prompt_text_is_a_prompt_error() -> None:
    # NOTE: it was a bare UnicodeEncodeError from the prefix hash in build().
    with pytest.raises(CanonicalizationError, match="surrogate"):
        normalize_text("a\ud800")
    with pytest.raises(PromptError, match="surrogate"):
        PromptBuilder().system("s\ud800").user("x").build()
    assert normalize_text("a\U0001f600") == "a\U0001f600"  # a pair is one code point


def nested(depth: int, *, wrap: Any) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = wrap(value)
    return value


@pytest.mark.parametrize(
    "wrap", [lambda v: {"a": v}, lambda v: [v], lambda v: (v,), lambda v: frozenset([v])]
)
def test_values_nested_past_max_depth_are_refused_by_name(wrap: Any) -> None:
    assert json.loads(canonical_json(nested(MAX_DEPTH, wrap=wrap))) is not None
    # NOTE: 900 levels was a bare RecursionError; MAX_DEPTH + 1 is the first refused.
    for depth in (MAX_DEPTH + 1, 900, 5000):
        with pytest.raises(CanonicalizationError, match=f"more than {MAX_DEPTH} levels deep"):
            canonical_json(nested(depth, wrap=wrap))


def test_a_too_deep_tool_schema_is_a_prompt_error() -> None:
    params = {"type": "object", "properties": nested(900, wrap=lambda v: {"x": v})}
    tool = {"type": "function", "function": {"name": "deep", "parameters": params}}
    with pytest.raises(PromptError, match="levels deep"):
        PromptBuilder().tools([tool]).user("x").build()


def test_stable_hash_frames_its_parts() -> None:
    assert stable_hash("ab", "c") != stable_hash("a", "bc")
    assert stable_hash("x") == stable_hash(b"x")
    # The framing is part of the contract (keys must survive releases): 8-byte big-endian length,
    # then the bytes, all under SHA-256.
    framed = (10).to_bytes(8, "big") + b"agentcache"
    assert stable_hash("agentcache") == hashlib.sha256(framed).hexdigest()
