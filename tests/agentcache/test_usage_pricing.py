"""Provider usage mapping (None when unreported), dated prices and token counting."""

from __future__ import annotations

import pytest
import tiktoken

from agentcache import tokens
from agentcache.pricing import PRICES, cost, price_for
from agentcache.usage import Usage
from agentcache.usage_mapping import (
    usage_from_anthropic,
    usage_from_deepseek,
    usage_from_openai,
    usage_from_vllm,
)


def test_openai_chat_and_responses() -> None:
    chat = {
        "usage": {
            "prompt_tokens": 2000,
            "completion_tokens": 50,
            "prompt_tokens_details": {"cached_tokens": 1536},
        }
    }
    assert usage_from_openai(chat) == Usage(
        prompt_tokens=2000, completion_tokens=50, cached_tokens=1536
    )
    resp = {"input_tokens": 900, "output_tokens": 7, "input_tokens_details": {"cached_tokens": 0}}
    assert usage_from_openai(resp) == Usage(prompt_tokens=900, completion_tokens=7, cached_tokens=0)


def test_vllm_without_details_reports_none_not_zero() -> None:
    u = usage_from_vllm(
        {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": None}
    )
    assert u.cached_tokens is None and u.prompt_tokens == 10
    assert u.hit_rate is None


def test_anthropic_input_tokens_exclude_cache_reads_and_writes() -> None:
    u = usage_from_anthropic(
        {
            "usage": {
                "input_tokens": 12,
                "output_tokens": 30,
                "cache_read_input_tokens": 3000,
                "cache_creation_input_tokens": 500,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": 200,
                    "ephemeral_1h_input_tokens": 300,
                },
            }
        }
    )
    assert (u.prompt_tokens, u.cached_tokens, u.cache_write_tokens) == (3512, 3000, 500)
    assert (u.cache_write_5m_tokens, u.cache_write_1h_tokens) == (200, 300)
    bare = usage_from_anthropic({"input_tokens": 5, "output_tokens": 1})
    assert bare.cached_tokens is None and bare.cache_write_1h_tokens is None


def test_deepseek_hit_and_miss() -> None:
    u = usage_from_deepseek(
        {
            "prompt_tokens": 100,
            "completion_tokens": 4,
            "prompt_cache_hit_tokens": 64,
            "prompt_cache_miss_tokens": 36,
        }
    )
    assert (u.prompt_tokens, u.cached_tokens) == (100, 64)


def test_every_price_row_is_dated_and_sourced() -> None:
    for row in PRICES:
        assert row.source.startswith("https://") and len(row.reviewed) == 10
        assert row.cache_read <= row.input <= row.output


def test_cost_splits_categories_and_matches_dated_snapshots() -> None:
    assert price_for("claude-sonnet-4-5-20250929") is price_for("claude-sonnet-4")
    assert price_for("gpt-4o-mini-2024-07-18") is not price_for("gpt-4o")
    usage = Usage(
        prompt_tokens=1_000_000 + 3_000_000 + 500_000,
        completion_tokens=100_000,
        cached_tokens=3_000_000,
        cache_write_tokens=500_000,
        cache_write_5m_tokens=200_000,
        cache_write_1h_tokens=300_000,
    )
    c = cost(usage, "claude-sonnet-4-5")
    assert c is not None
    row = c.price
    assert c.input_usd == pytest.approx(row.input)
    assert c.cache_read_usd == pytest.approx(3 * row.cache_read)
    assert c.cache_write_usd == pytest.approx(0.2 * row.cache_write_5m + 0.3 * row.cache_write_1h)  # type: ignore[operator]
    assert c.output_usd == pytest.approx(0.1 * row.output)
    assert cost(usage, "unknown-model") is None
    assert cost(Usage(prompt_tokens=10), "gpt-4o") is None
    unreported = cost(Usage(prompt_tokens=10, completion_tokens=1), "gpt-4o")
    assert unreported is not None and unreported.notes


def small_encoding() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"ab"] = 256
    return tiktoken.Encoding("tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})


def test_token_counting_prefers_tokenizer_then_tiktoken_then_labelled_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    enc = small_encoding()
    assert tokens.count_tokens("abab", tokenizer=enc) == 2
    monkeypatch.setattr(
        tokens, "tiktoken_encoding", lambda model: enc if model == "gpt-4o" else None
    )
    assert tokens.token_count("abab c", model="gpt-4o") == (4, "tiktoken")
    offline = tokens.token_count("x" * 40, model="claude-sonnet-4-5")
    assert offline.is_estimate and offline.value == 10
    with pytest.raises(tokens.TokenizerUnavailableError):
        tokens.count_tokens("x", model="claude-sonnet-4-5")


def test_tiktoken_encoding_is_none_for_non_openai_models() -> None:
    assert tokens.tiktoken_encoding("claude-sonnet-4-5") is None
