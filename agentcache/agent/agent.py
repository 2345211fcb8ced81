"""The agent loop: build prompt -> call backend -> parse tool calls -> run tools -> repeat.

The conversation is append-only (system + tools + pinned documents never change, history only
grows), so every model call extends the previous prompt and the backend's prefix cache can reuse
it. Knows nothing about a backend's transport or a model's tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from agentcache.agent.parsing import MarkupFilter, parse_hermes
from agentcache.agent.tools import ToolOutcome, ToolRegistry
from agentcache.backends.base import (
    BaseBackend,
    GenerationOptions,
    ModelResponse,
    ToolCall,
    ToolChoice,
)
from agentcache.canonical import canonical_json
from agentcache.exceptions import AgentError, ConfigError
from agentcache.prompt import Document, Prompt, PromptBuilder
from agentcache.prompt._templates import render_template

if TYPE_CHECKING:
    from agentcache.cache import ToolCache
    from agentcache.cache.base import CacheStats
    from agentcache.cache.scope import ScopeKind
    from agentcache.cache.tool import DependsOn
    from agentcache.usage import Usage

__all__ = ["Agent", "AgentConfig", "AgentResult", "PlannedCall", "Planner", "Step"]

Message: TypeAlias = dict[str, Any]
PlannedCall: TypeAlias = tuple[str, dict[str, Any]]
"""A tool call chosen outside the model: (tool name, arguments)."""
Planner: TypeAlias = Callable[[str], Sequence[PlannedCall]]
"""Given the user's text, the tool calls to run before the model answers (may be empty)."""

FORMAT_HINT = (
    'Call a tool as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>, '
    "or answer in plain text."
)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Options of one agent."""

    max_steps: int = 6
    """Model calls allowed per ``run`` (tool rounds + the final answer)."""
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    """Sampling options for every model call."""
    namespace: str = "default"
    """Prompt namespace (tenant/app), part of every prompt fingerprint."""
    raise_on_step_limit: bool = True
    """``True``: hitting ``max_steps`` raises ``AgentError``; ``False``: returns what there is."""
    planned_results: Literal["tool_messages", "context"] = "tool_messages"
    """Where the planner's tool results go: ``"tool_messages"`` (an assistant turn with the
    calls, then one ``tool`` message per result) or ``"context"`` (the RAG pipeline before
    generation: the user turn becomes ``templates/context_question.jinja``, the results then
    the question; small models answer from that where they copy tool messages back)."""
    tool_choices: tuple[ToolChoice, ...] = ()
    """``tool_choice`` of the model calls of each ``run``, in order (later calls use
    ``generation.tool_choice``). ``("required", "none")``: call a tool first (the local backend
    constrains the call's JSON to the tools' schemas), then answer in text: every turn
    retrieves, however weak the model."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps!r}")
        bad = [c for c in self.tool_choices if c not in ("auto", "required", "none")]
        if bad:
            raise ValueError(f"tool_choices must be 'auto', 'required' or 'none', got {bad[0]!r}")


@dataclass(frozen=True, slots=True)
class Step:
    """One round: a model call (or a planned tool round) and the tools it ran."""

    response: ModelResponse | None
    """The model's response; ``None`` for a planner round."""
    tool_calls: tuple[ToolCall, ...] = ()
    outcomes: tuple[ToolOutcome, ...] = ()


@dataclass(frozen=True, slots=True)
class AgentResult:
    """The outcome of ``Agent.run``."""

    output: str
    """The final answer text (markup removed)."""
    steps: tuple[Step, ...]
    finish_reason: Literal["stop", "max_steps"]
    tool_cache_stats: CacheStats | None = None
    """Tool-cache hits/misses during this run; ``None`` without a tool cache."""

    @property
    def usages(self) -> list[Usage]:
        """Usage of every model call, in order."""
        return [s.response.usage for s in self.steps if s.response is not None]

    @property
    def tool_calls(self) -> list[ToolCall]:
        """Every tool call of the run, in order."""
        return [call for step in self.steps for call in step.tool_calls]


class Agent:
    """An agent with tools, pinned documents and an append-only conversation."""

    def __init__(
        self,
        backend: BaseBackend,
        *,
        system: str = "",
        tools: Iterable[Callable[..., Any]] = (),
        documents: Iterable[Document] = (),
        tool_cache: ToolCache | None = None,
        tool_scope: ScopeKind = "narrowest",
        planner: Planner | None = None,
        config: AgentConfig | None = None,
    ) -> None:
        """Create an agent.

        Args:
            backend: Where model calls go (local, OpenAI-compatible, Anthropic, fake).
            system: System prompt; keep volatile values (dates, ids) out of it.
            tools: Functions to expose (type hints + docstrings); more via ``tool``.
            documents: Pinned documents, rendered in the stable system segment.
            tool_cache: Result cache for tools registered with ``cache=True``.
            tool_scope: Who shares the tools' cached results (rule in
                ``agentcache.cache.scope``): by default every id the active ``cache_scope``
                sets, so two tenants never see each other's results; ``"global"`` (or
                ``"tenant"``, ``"user"``, ``"session"``) opts in to wider sharing. Tools passed
                already wrapped by a ``ToolCache`` keep their own scope.
            planner: Chooses tool calls before the model answers (for models that cannot plan
                tool calls); they run through the same path and cache as the model's calls.
            config: Loop options.

        Raises:
            ConfigError: ``tool_scope`` is not a scope kind (checked with or without a
                ``tool_cache``), or ``tools`` is not a list of tools (one function given bare:
                the message says ``tools=[fn]``), or ``documents`` is not a list of
                ``Document`` (one given bare: the message says ``documents=[doc]``).
        """
        self.backend = backend
        self.system = system
        self.documents = _document_tuple(documents)
        self.planner = planner
        self.config = config or AgentConfig()
        self.registry = ToolRegistry(tool_cache, scope=tool_scope)
        self.registry.extend(tools)
        self._history: list[Message] = []
        self._num_calls = 0

    @property
    def history(self) -> tuple[Message, ...]:
        """The conversation so far (user, assistant and tool messages), oldest first."""
        return tuple(self._history)

    def tool(
        self,
        *,
        name: str | None = None,
        cache: bool = True,
        version: str | None = None,
        scope: ScopeKind | None = None,
        depends_on: DependsOn | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering a function as a tool (options as ``ToolRegistry.add``)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.registry.add(
                fn, name=name, cache=cache, version=version, scope=scope, depends_on=depends_on
            )
            return fn

        return register

    def build_prompt(self) -> Prompt:
        """The prompt of the next model call: stable segments first, then the history."""
        return (
            PromptBuilder(namespace=self.config.namespace)
            .system(self.system)
            .tools([spec.openai() for spec in self.registry.specs()])
            .documents(self.documents)
            .history(self._history)
            .build()
        )

    def reset(self) -> None:
        """Start a new conversation (tools, documents and caches are kept)."""
        self._history.clear()
        self._num_calls = 0

    def run(self, user_text: str, *, on_text: Callable[[str], None] | None = None) -> AgentResult:
        """Answer ``user_text``, running tools until the model answers in plain text.

        Args:
            user_text: The user's message, appended to the history.
            on_text: Called with each streamed piece of visible answer text; ``<tool_call>``
                markup is never passed on, whatever the backend.

        Returns:
            The final answer and every step.

        Raises:
            AgentError: ``max_steps`` model calls without a final answer (when
                ``config.raise_on_step_limit``).
            BackendError: The backend failed (its subclasses say how).
        """
        cache = self.registry.tool_cache
        before = cache.stats() if cache is not None else None
        self._history.append({"role": "user", "content": user_text})
        steps: list[Step] = []
        if self.planner is not None:
            planned = self._planned_calls(self.planner(user_text))
            if planned and self.config.planned_results == "context":
                steps.append(self._run_as_context(user_text, planned))
            elif planned:
                steps.append(self._run_calls(None, "", planned))
        output, finish = "", "max_steps"
        for index in range(self.config.max_steps):
            response = self._call_model(on_text, self._options(index))
            step, output = self._handle(response)
            steps.append(step)
            if not step.tool_calls and step.outcomes == ():
                finish = "stop"
                break
        stats = cache.stats().since(before) if cache is not None and before is not None else None
        if finish == "max_steps" and self.config.raise_on_step_limit:
            raise AgentError(
                f"no final answer after max_steps={self.config.max_steps} model calls; "
                "raise AgentConfig.max_steps or check the tools' results"
            )
        return AgentResult(output, tuple(steps), finish, stats)  # type: ignore[arg-type]

    def _options(self, index: int) -> GenerationOptions:
        """The generation options of the run's ``index``-th model call (its ``tool_choice``)."""
        choices = self.config.tool_choices
        if index >= len(choices):
            return self.config.generation
        return dataclasses.replace(self.config.generation, tool_choice=choices[index])

    def _call_model(
        self, on_text: Callable[[str], None] | None, options: GenerationOptions
    ) -> ModelResponse:
        prompt = self.build_prompt()
        # NOTE: native backends too: a server without a tool parser sends Hermes markup as text.
        markup = MarkupFilter()
        final: ModelResponse | None = None
        for event in self.backend.stream(prompt, options):
            visible = markup.feed(event.text)
            if on_text is not None and visible:
                on_text(visible)
            final = event.response or final
        rest = markup.flush()
        if on_text is not None and rest:
            on_text(rest)
        assert final is not None, "BaseBackend.stream ends with a response"
        return final

    def _handle(self, response: ModelResponse) -> tuple[Step, str]:
        if self.backend.capabilities.tool_call_format == "native":
            calls, errors, content = list(response.tool_calls), [], response.text
        else:
            parsed = parse_hermes(response.text)
            calls = self._planned_calls([(c.name, c.arguments) for c in parsed.calls])
            errors, content = parsed.errors, parsed.content
        if errors:
            # NOTE: keep the model's own text so it sees what it wrote, then say what was wrong.
            self._history.append({"role": "assistant", "content": response.text})
            outcomes = tuple(self._run_and_record(calls))
            hint = "\n".join(errors) + "\n" + FORMAT_HINT
            self._history.append({"role": "user", "content": hint})
            error_outcome = ToolOutcome(hint, True)
            return Step(response, tuple(calls), (*outcomes, error_outcome)), content
        if not calls:
            self._history.append({"role": "assistant", "content": content})
            return Step(response), content
        return self._run_calls(response, content, calls), content

    def _run_calls(
        self, response: ModelResponse | None, content: str, calls: Sequence[ToolCall]
    ) -> Step:
        message: Message = {"role": "assistant", "content": content or None}
        message["tool_calls"] = [call.to_openai() for call in calls]
        self._history.append(message)
        outcomes = tuple(self._run_and_record(calls))
        return Step(response, tuple(calls), outcomes)

    def _run_as_context(self, user_text: str, calls: Sequence[ToolCall]) -> Step:
        """Run planned ``calls`` and put their results before the question in the user turn.

        NOTE: the user turn was appended by ``run`` and no model has seen it yet, so replacing
        it keeps the conversation append-only for every prompt the backend was sent.
        """
        outcomes = tuple(self.registry.run(call) for call in calls)
        text = render_template(
            "context_question.jinja", results=[o.content for o in outcomes], question=user_text
        )
        self._history[-1] = {"role": "user", "content": text}
        return Step(None, tuple(calls), outcomes)

    def _run_and_record(self, calls: Sequence[ToolCall]) -> list[ToolOutcome]:
        outcomes = []
        for call in calls:
            outcome = self.registry.run(call)
            outcomes.append(outcome)
            self._history.append(
                {"role": "tool", "tool_call_id": call.id, "content": outcome.content}
            )
        return outcomes

    def _planned_calls(self, planned: Sequence[tuple[str, Any]]) -> list[ToolCall]:
        calls = []
        for name, arguments in planned:
            text = arguments if isinstance(arguments, str) else canonical_json(arguments)
            calls.append(ToolCall(id=f"call_{self._num_calls}", name=name, arguments=text))
            self._num_calls += 1
        return calls


def _document_tuple(documents: Iterable[Document]) -> tuple[Document, ...]:
    """``documents`` as a tuple, or a ConfigError naming the fix for a bare one, a string or None
    (iterating those gave "'Document' object is not iterable" or one entry per character)."""
    if isinstance(documents, Document):
        raise ConfigError(
            f"documents: got the single document {documents.id!r}; pass documents=[doc]"
        )
    if documents is None or isinstance(documents, (str, bytes)):
        kind = "None" if documents is None else "a string"
        raise ConfigError(f"documents: got {kind}; pass a list of Document (documents=[] for none)")
    docs = tuple(documents)
    for i, doc in enumerate(docs):
        if not isinstance(doc, Document):
            raise ConfigError(f"documents[{i}] is a {type(doc).__name__}, not a Document")
    return docs
