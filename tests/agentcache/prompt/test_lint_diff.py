"""lint and diff on realistic request bodies, plus the ``agentcache lint|diff`` CLI exit codes."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from agentcache.cli import main
from agentcache.prompt import Document, PromptBuilder, diff, lint

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge base.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"properties": {}, "type": "object"}},
}
SYSTEM = (
    "You are the support assistant for Acme. Answer from the documents only.\n\n"
    '<documents>\n<document id="faq">\nReturns are free within 30 days.\n</document>\n'
    '<document id="shipping">\nWe ship worldwide.\n</document>\n</documents>'
)


def openai_body(system: str = SYSTEM, tools: list[Any] | None = None) -> dict[str, Any]:
    return {
        "model": "gpt-4o",
        "tools": [ADD, SEARCH] if tools is None else tools,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Can I return shoes?"},
        ],
    }


def reorder_keys(tool: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(tool)
    params = out["function"]["parameters"]
    out["function"]["parameters"] = {k: params[k] for k in reversed(list(params))}
    return out


def test_clean_builder_prompt_has_no_warnings() -> None:
    p = PromptBuilder().system("Be brief.").tools([SEARCH, ADD]).user("hi").build()
    assert [f for f in lint(p) if f.severity == "warning"] == []


def test_lint_finds_timestamp_in_system_prompt() -> None:
    body = openai_body(system="Current time: 2026-11-29T13:59:10Z.\n" + SYSTEM)
    findings = [f for f in lint(body) if f.code == "AC101"]
    assert len(findings) == 1
    assert (findings[0].segment, findings[0].offset) == ("system", len("Current time: "))
    assert "2026" not in findings[0].message  # no prompt content in findings


def test_lint_finds_uuid_request_id_and_counter() -> None:
    body = openai_body(
        system="req_id: a1b2c3d4e5f6 session 123e4567-e89b-12d3-a456-426614174000, turn 7"
    )
    kinds = sorted(f.message.split(" in ")[0] for f in lint(body) if f.code == "AC101")
    assert kinds == ["counter", "request id", "uuid"]


def test_lint_finds_unsorted_json_and_unsorted_tools() -> None:
    codes = {f.code for f in lint(openai_body(tools=[SEARCH, reorder_keys(ADD)]))}
    assert {"AC102", "AC103"} <= codes


def test_lint_flags_tools_changed_between_builds_and_score_order() -> None:
    before = PromptBuilder().tools([SEARCH]).build()
    after = PromptBuilder().tools([SEARCH, ADD]).build()
    assert [f.code for f in lint(after, previous=before)] == ["AC104"]
    docs = [
        Document("b", "x", metadata={"score": 0.9}),
        Document("a", "y", metadata={"score": 0.2}),
    ]
    pinned = PromptBuilder().documents(docs, pinned_order=True).build()
    assert "AC105" in {f.code for f in lint(pinned)}
    assert "AC105" not in {f.code for f in lint(PromptBuilder().documents(docs).build())}


def test_lint_anthropic_breakpoints_and_minimum() -> None:
    marker = {"type": "ephemeral"}
    body = {
        "model": "claude-haiku-4-5",
        "system": [{"type": "text", "text": "Be brief.", "cache_control": marker}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": t, "cache_control": marker}]}
            for t in ("a", "b", "c", "d")
        ],
    }
    codes = {f.code for f in lint(body)}
    assert {"AC107", "AC106"} <= codes


def test_diff_reordered_tool_schema_is_key_order() -> None:
    a = openai_body(tools=[ADD, SEARCH])
    b = openai_body(tools=[ADD, reorder_keys(SEARCH)])
    result = diff(a, b)
    assert (result.change, result.segment, result.part) == ("key_order", "tools", "tool 'search'")
    assert result.reason == "tool 'search' schema: key order differs (same values)"
    expected = len((json.dumps(ADD, separators=(",", ":")) + "\n").encode())
    assert result.byte_offset is not None and result.byte_offset > expected


def test_diff_timestamp_in_system_prompt() -> None:
    a = openai_body(system="Now: 2026-11-29T13:59:10Z. " + SYSTEM)
    b = openai_body(system="Now: 2026-11-29T14:02:44Z. " + SYSTEM)
    result = diff(a, b)
    assert result.change == "changed" and result.segment == "system"
    assert "looks like a timestamp" in result.reason
    assert result.excerpt_a is None and "2026" not in result.reason


def test_diff_changed_document_names_offset_and_shows_content_on_request() -> None:
    a = openai_body()
    b = openai_body(system=SYSTEM.replace("30 days", "14 days"))
    result = diff(a, b, show_content=True)
    assert result.part == "system message 0"
    assert f"offset {SYSTEM.index('30 days')}" in result.reason
    assert result.excerpt_a and "30 days" in result.excerpt_a
    assert result.excerpt_b and "14 days" in result.excerpt_b


def test_diff_extension_is_not_a_divergence() -> None:
    a = openai_body()
    b = openai_body()
    b["messages"] += [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Thx"}]
    result = diff(a, b)
    assert (result.change, result.is_divergent) == ("extension", False)
    assert diff(a, a).change == "identical"


def test_diff_builder_prompts_tool_added() -> None:
    a = PromptBuilder().tools([SEARCH]).user("q").build()
    b = PromptBuilder().tools([SEARCH, ADD]).user("q").build()
    result = diff(a, b)
    assert (result.change, result.part) == ("added", "tool 'search'")
    assert result.reason == "tool 'add' added before tool 'search'"
    assert result.byte_offset is not None and result.byte_offset < len(a.tools[0].json)


def test_diff_tools_added_to_a_body_without_tools() -> None:
    a = openai_body(tools=[])
    b = openai_body(tools=[ADD, SEARCH])
    result = diff(a, b)
    assert (result.change, result.segment, result.part) == ("added", "tools", "tool 'add'")
    assert result.reason == "tools added: B has tool 'add' where A has system message 0"
    assert result.byte_offset == 0
    back = diff(b, a)
    assert (back.change, back.segment, back.part) == ("removed", "tools", "tool 'add'")


def test_diff_one_more_tool_between_tools_and_system() -> None:
    result = diff(openai_body(tools=[ADD]), openai_body(tools=[ADD, SEARCH]))
    assert (result.change, result.part) == ("added", "tool 'search'")
    assert result.reason == "tool 'search' added before system message 0"


def test_diff_openai_vs_anthropic_body_reports_the_provider_shapes() -> None:
    prompt = PromptBuilder().system("Be brief.").tools([SEARCH]).user("q").build()
    openai = prompt.to_openai(model="gpt-4o")
    anthropic = prompt.to_anthropic(model="claude-sonnet-4-5")
    result = diff(openai, anthropic)
    assert (result.change, result.is_divergent) == ("provider", True)
    assert "different provider shapes (openai vs anthropic)" in result.reason
    assert "description" not in result.reason
    assert diff(anthropic, anthropic).change == "identical"


# --- CLI -------------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, body: Any) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(body) if not isinstance(body, str) else body)
    return str(path)


def test_cli_lint_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = write(tmp_path, "clean.json", openai_body(tools=[ADD, SEARCH]))
    dirty = write(tmp_path, "dirty.json", openai_body(system="Date: 2026-11-29. " + SYSTEM))
    assert main(["lint", clean]) == 0
    assert main(["lint", dirty]) == 1
    capsys.readouterr()
    assert main(["lint", dirty, "--json"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    warnings = [f for f in out["findings"] if f["severity"] == "warning"]
    assert [(f["code"], f["segment"], f["offset"]) for f in warnings] == [("AC101", "system", 6)]


def test_cli_diff_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path, "a.json", openai_body(tools=[ADD, SEARCH]))
    b = write(tmp_path, "b.json", openai_body(tools=[ADD, reorder_keys(SEARCH)]))
    assert main(["diff", a, a]) == 0
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "key order differs" in out and "Search the knowledge base" not in out
    assert main(["diff", a, b, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["change"] == "key_order"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"model": "x"}', "'messages' list"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was a RecursionError traceback
    ],
)
def test_cli_bad_input_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, expected: str
) -> None:
    path = str(tmp_path / "missing.json") if content is None else write(tmp_path, "x.json", content)
    good = write(tmp_path, "good.json", openai_body())
    assert main(["lint", path]) == 2
    assert main(["diff", good, path]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_cli_lint_of_a_tool_schema_too_deep_to_walk_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # NOTE: json.loads reads 950 levels, lint's recursive walk then overflowed (exit 1, as if it
    # had found warnings, with a traceback).
    deep = "[" * 950 + "]" * 950
    body = (
        '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        f'"function": {{"name": "f", "parameters": {{"type": "object", "properties": {{"a": {deep}'
        "}}}}]}"
    )
    assert main(["lint", write(tmp_path, "deep.json", body)]) == 2
    err = capsys.readouterr().err
    assert "nested too deeply" in err and "Traceback" not in err


def test_cli_lint_fits_80_columns_with_a_severity_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    dirty = write(tmp_path, "dirty.json", openai_body(system="Date: 2026-11-29. " + SYSTEM))
    assert main(["lint", dirty]) == 1
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "severity" in out and "warning" in out and "AC101" in out
    assert "exit 1: 1 warning(s) break the prefix cache" in out


def test_cli_diff_openai_vs_anthropic_names_no_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write(tmp_path, "a.json", openai_body())
    anthropic = {
        "model": "claude",
        "max_tokens": 16,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "hi"}],
    }
    b = write(tmp_path, "b.json", anthropic)
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "None" not in out and "different provider shapes" in out


class WordTokenizer:
    """One token per word with its leading spaces, one per other character: the token that
    covers a mid-word seam is the whole word, as with BPE merges."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = re.findall(r"\s*\w+|\s+|.", text, flags=re.DOTALL)
        return [self.vocab.setdefault(piece, len(self.vocab)) for piece in pieces]


def test_diff_with_a_tokenizer_counts_only_shared_tokens_at_a_mid_word_seam() -> None:
    tok = WordTokenizer()
    text_a = "Answer in the register of a friendly librarian, briefly."
    text_b = "Answer in the register of a friendly libertarian, briefly."
    a = PromptBuilder().system(text_a).user("hi").build()
    b = PromptBuilder().system(text_b).user("hi").build()
    result = diff(a, b, tokenizer=tok)
    seam = next(i for i, (x, y) in enumerate(zip(text_a, text_b, strict=False)) if x != y)
    word_start = text_a.rindex(" ", 0, seam)
    assert (result.change, result.segment, result.token_offset_is_estimate) == (
        "changed",
        "system",
        False,
    )
    assert result.byte_offset == seam
    assert result.token_offset == len(tok.encode(text_a[:word_start]))  # " librarian" differs
    assert len(tok.encode(text_a[:seam])) == result.token_offset + 1  # the old count


def test_diff_without_a_tokenizer_labels_the_count_an_estimate() -> None:
    a = PromptBuilder().system("Be brief and kind.").user("hi").build()
    b = PromptBuilder().system("Be brief and calm.").user("hi").build()
    result = diff(a, b, model="local-model")
    assert result.token_offset_is_estimate
    assert result.token_offset == -(-len(b"Be brief and ") // 4)
