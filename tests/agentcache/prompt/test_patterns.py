"""The volatile-value detectors shared by lint and diff: what they catch and what they leave."""

from __future__ import annotations

import pytest

from agentcache.prompt import PromptBuilder, lint
from agentcache.prompt._patterns import describe_at, find_volatile


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("The meeting is at 14:05 today.", "time", "14:05"),
        ("Last sync 09:30 UTC.", "time", "09:30"),
        ("Opens 9:15 am sharp.", "time", "9:15 am"),
        ("Closes at 7:45PM.", "time", "7:45PM"),
        ("Uptime since 9:05:33.", "time", "9:05:33"),
        ("Logged 14:05:33.250 here.", "time", "14:05:33.250"),
        ("Today is 29 November 2026.", "date", "29 November 2026"),
        ("Today is 29 Nov 2026.", "date", "29 Nov 2026"),
        ("Today is 1 Sept. 2026.", "date", "1 Sept. 2026"),
        ("Today is the 3rd of March, 2026.", "date", "3rd of March, 2026"),
        ("Stand: 29.11.2026, Berlin.", "date", "29.11.2026"),
        ("Stand: 1.2.2026.", "date", "1.2.2026"),
    ],
)
def test_time_and_european_dates_are_volatile(text: str, kind: str, value: str) -> None:
    found = find_volatile(text)
    assert [(m.kind, text[m.start : m.end]) for m in found] == [(kind, value)]
    assert describe_at(text, text.index(value)) == kind


@pytest.mark.parametrize(
    "text",
    [
        "Requires Python 3.11.7 or newer.",
        "Pinned to version 1.2.3 and 10.12.1.",
        "Release 2.31.2026 of the tool.",  # NOTE: no 31st month: a version, not a date
        "Build v10.12.2020 is old.",  # NOTE: a letter right before it: a version tag
        "Mix them 3:2, render at 16:9 or 4:3, scale 1:10.",
        "Read John 3:16 and chapter 12:75.",
        "MAC 00:1a:2b:3c:4d:5e, range 10:00:00:00:01.",
        "Scored 29 points in 2026 games; May 2026 is a month.",
        "IP 192.168.10.12 and 12.10.20266 are not dates.",
    ],
)
def test_versions_ratios_and_numbers_are_not_volatile(text: str) -> None:
    assert find_volatile(text) == []


def test_lint_flags_a_clock_time_and_a_spelled_date_in_the_system_prompt() -> None:
    system = "You are helpful. It is 14:05 on 29 November 2026 (29.11.2026). Python 3.11.7."
    prompt = PromptBuilder().system(system).user("hi").build()
    findings = [f for f in lint(prompt) if f.code == "AC101"]
    assert [(f.offset, f.message.split(" in ")[0]) for f in findings] == [
        (system.index("14:05"), "time"),
        (system.index("29 November"), "date"),
        (system.index("29.11"), "date"),
    ]
