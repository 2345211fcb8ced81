"""Token-prefix stability across a 5-turn tool-using conversation on in-process tokenizers.

The tokenizers are trained here with the ``tokenizers`` library (byte-level BPE, no downloads) and
wrapped in ``PreTrainedTokenizerFast`` with hand-written chat templates: ChatML with tools, a
Llama-3-style header template, a plain "Role: text" template whose generation prompt ends in a
space (a boundary-merge trap) and a template that strips earlier reasoning (rewrites history).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from agentcache.prompt import Document, Prompt, PromptBuilder  # noqa: E402
from agentcache.prompt.token_prefix import (  # noqa: E402
    TemplateRewritesHistoryError,
    check_token_prefix,
    stable_token_ids,
)

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]

CHATML = (
    "{% if messages[0].role == 'system' or tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "{% endif %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>"
    "{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'system' and tools %}{{ m.content }}\n\nTools:"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments }}}{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PLAIN = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments }}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)
STRIPS_REASONING = CHATML.replace(
    "{{ m.content or '' }}",
    "{{ (m.content or '').split('</think>')[-1] if not loop.last else (m.content or '') }}",
)


@functools.cache
def tokenizer(template: str) -> Any:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [CHATML, LLAMA3, PLAIN, *(str(m) for m in turns()[-1].to_messages())] * 3
    corpus += ["Assistant: You are welcome. You are welcome."] * 5  # NOTE: learns " You".
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    tok.chat_template = template
    return tok


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First addend.
        b: Second addend.
    """
    return a + b


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"b":3,"a":2}'},
}


@functools.cache
def turns() -> list[Prompt]:
    """The prompt of each of the 5 model calls of one conversation (one of them after a tool)."""
    base = PromptBuilder(namespace="t").system("You are a calculator.").tools([add])
    base = base.documents([Document("rules", "Answer with one number.")])
    history: list[dict[str, Any]] = []
    steps: list[tuple[str | None, list[dict[str, Any]]]] = [
        ("What is 2+3?", [{"role": "assistant", "content": None, "tool_calls": [CALL]}]),
        (None, [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]),
        (None, [{"role": "assistant", "content": "<think>easy</think>It is 5."}]),
        ("And times 4?", [{"role": "assistant", "content": "20"}]),
        ("Thanks!", [{"role": "assistant", "content": "You are welcome."}]),
    ]
    prompts = []
    pending_user: str | None = None
    for user, replies in steps:
        if user is not None:
            pending_user = user
        if replies[0]["role"] == "tool":
            history.extend(replies)
            continue
        builder = base.copy().history(history)
        prompts.append(builder.user(pending_user).build() if pending_user else builder.build())
        if pending_user:
            history.append({"role": "user", "content": pending_user})
            pending_user = None
        history.extend(replies)
    prompts.append(base.copy().history(history).user("Bye.").build())
    return prompts


def test_conversation_has_five_model_calls_with_a_tool_turn() -> None:
    prompts = turns()
    assert len(prompts) == 5
    assert any(m["role"] == "tool" for m in prompts[1].history)


@pytest.mark.parametrize("template", [CHATML, LLAMA3, PLAIN], ids=["chatml", "llama3", "plain"])
def test_each_turn_is_a_strict_token_prefix_of_the_next(template: str) -> None:
    tok = tokenizer(template)
    prompts = turns()
    for a, b in zip(prompts, prompts[1:], strict=False):
        report = check_token_prefix(tok, a, b)
        assert report.is_prefix, report
        assert report.reason == "ok"


def test_whole_text_tokenization_merges_at_the_generation_prompt() -> None:
    tok = tokenizer(PLAIN)
    a, b = turns()[3], turns()[4]  # b adds "Assistant: You are welcome."
    naive = check_token_prefix(tok, a, b, stable=False)
    assert not naive.is_prefix
    assert naive.reason == "boundary_merge"
    assert check_token_prefix(tok, a, b).is_prefix


def test_stable_ids_decode_to_the_template_text() -> None:
    tok = tokenizer(CHATML)
    prompt = turns()[3]
    text = tok.apply_chat_template(
        prompt.to_messages(),
        tools=prompt.tool_schemas(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(stable_token_ids(tok, prompt)) == text


def test_template_that_strips_earlier_reasoning_is_reported() -> None:
    tok = tokenizer(STRIPS_REASONING)
    prompts = turns()
    with pytest.raises(TemplateRewritesHistoryError) as exc:
        stable_token_ids(tok, prompts[3])
    rewritten = prompts[3].to_messages()[exc.value.message_index]  # the message rendered anew
    assert (rewritten["role"], str(rewritten["content"])[:7]) == ("assistant", "<think>")
    report = check_token_prefix(tok, prompts[2], prompts[3])
    assert (report.is_prefix, report.reason) == (False, "history_rewritten")


def test_changed_system_prompt_is_a_content_change() -> None:
    tok = tokenizer(CHATML)
    a = turns()[0]
    b = PromptBuilder(namespace="t").system("You are a poet.").tools([add]).user("Hi").build()
    report = check_token_prefix(tok, a, b)
    assert (report.is_prefix, report.reason, report.message_index) == (False, "content_changed", 0)


def whole_text_ids(tok: Any, prompt: Prompt) -> list[int]:
    messages, tools = prompt.to_messages(), prompt.tool_schemas()
    kwargs = {"tools": tools, "tokenize": False, "add_generation_prompt": True}
    text = tok.apply_chat_template(messages, **kwargs)
    return list(tok.encode(text, add_special_tokens=False))


def test_a_rewriting_template_reports_the_true_common_prefix_and_the_rewritten_message() -> None:
    # The template strips <think> from an assistant turn once it is no longer last, so neither
    # prompt can be cut per message: the report counts whole-text ids instead of 0s.
    tok = tokenizer(STRIPS_REASONING)
    a = turns()[2]
    msgs = a.to_messages()
    k = len(msgs) - 1  # the last user message differs
    b = PromptBuilder(namespace="t").system("You are a calculator.").tools([add])
    b = b.documents([Document("rules", "Answer with one number.")]).history(list(a.history))
    b_prompt = b.user("And times 5?").build()
    assert b_prompt.to_messages()[:k] == msgs[:k] and b_prompt.to_messages()[k] != msgs[k]
    ids_a, ids_b = whole_text_ids(tok, a), whole_text_ids(tok, b_prompt)
    true_common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    report = check_token_prefix(tok, a, b_prompt)
    assert (report.is_prefix, report.reason) == (False, "history_rewritten")
    assert (report.common_len, report.len_a, report.len_b) == (
        true_common,
        len(ids_a),
        len(ids_b),
    )
    assert true_common > 12
    assert report.message_index is not None
    assert str(msgs[report.message_index]["content"]).startswith("<think>")


def test_changed_message_k_is_named_with_the_shared_token_prefix() -> None:
    tok = tokenizer(CHATML)
    a = turns()[3]
    history = [dict(m) for m in a.history]
    k = next(i for i, m in enumerate(history) if m["role"] == "tool")
    history[k]["content"] = "6"
    base = PromptBuilder(namespace="t").system("You are a calculator.").tools([add])
    b = base.documents([Document("rules", "Answer with one number.")]).history(history)
    b_prompt = b.user(a.user or "").build()
    ids_a, ids_b = stable_token_ids(tok, a), stable_token_ids(tok, b_prompt)
    true_common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    report = check_token_prefix(tok, a, b_prompt)
    index = k + 1  # NOTE: to_messages() puts the system message first
    assert a.to_messages()[index]["role"] == "tool"
    assert (report.reason, report.message_index, report.common_len) == (
        "content_changed",
        index,
        true_common,
    )


def test_changed_tools_are_a_content_change_not_a_history_rewrite() -> None:
    tok = tokenizer(CHATML)
    a = turns()[0]

    def mul(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: First factor.
            b: Second factor.
        """
        return a * b

    base = PromptBuilder(namespace="t").system("You are a calculator.").tools([add, mul])
    b = base.documents([Document("rules", "Answer with one number.")]).user(a.user or "").build()
    assert b.to_messages() == a.to_messages()
    report = check_token_prefix(tok, a, b)
    assert (report.is_prefix, report.reason, report.message_index) == (
        False,
        "content_changed",
        None,
    )
