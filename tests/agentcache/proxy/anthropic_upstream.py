"""A small Anthropic-shaped Messages server for tests: strict about markers, honest about reads.

It answers ``POST /v1/messages`` with a fixed one-word reply, after validating the body the way
the proxy must respect: at most 4 ``cache_control`` markers (nested ones counted) and none whose
prefix is shorter than the minimum (a stricter rule than the real API, which silently skips those
markers). Its prompt cache follows Anthropic's documented prefix rule with its own counting (bytes
of canonical JSON / 4): a marker's prefix is every block up to and including it; a request reads
the longest marker prefix an earlier request wrote, and writes the rest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

MINIMUM_TOKENS = 1024


def _blocks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Tools, system blocks and message content blocks in prefix order (nested ones before
    their tool_result)."""
    out: list[dict[str, Any]] = []

    def walk(block: Any) -> None:
        if not isinstance(block, dict):
            return
        if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            for child in block["content"]:
                walk(child)
        out.append(block)

    for tool in body.get("tools") or []:
        walk(tool)
    system = body.get("system")
    for block in [{"type": "text", "text": system}] if isinstance(system, str) else system or []:
        walk(block)
    for message in body.get("messages") or []:
        content = message["content"]
        for block in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            walk(block)
    return out


def _tokens(blocks: list[dict[str, Any]]) -> int:
    plain = [{k: v for k, v in b.items() if k != "cache_control"} for b in blocks]
    return len(json.dumps(plain, sort_keys=True).encode()) // 4


def _key(blocks: list[dict[str, Any]]) -> str:
    plain = [{k: v for k, v in b.items() if k != "cache_control"} for b in blocks]
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def _error(message: str) -> JSONResponse:
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    return JSONResponse(body, status_code=400)


def create_upstream() -> FastAPI:
    """The app; ``app.state.cache`` maps prefix keys to token counts, ``app.state.bodies`` keeps
    every accepted body."""
    app = FastAPI()
    app.state.cache = {}
    app.state.bodies = []

    @app.post("/v1/messages")
    async def messages(request: Request) -> JSONResponse:
        body = await request.json()
        blocks = _blocks(body)
        marked = [i for i, b in enumerate(blocks) if b.get("cache_control") is not None]
        if len(marked) > 4:
            return _error(
                f"A maximum of 4 blocks with cache_control may be provided. Found {len(marked)}."
            )
        for i in marked:
            if _tokens(blocks[: i + 1]) < MINIMUM_TOKENS:
                return _error(f"cache_control on block {i}: prefix below {MINIMUM_TOKENS} tokens")
        app.state.bodies.append(body)
        read = max(
            (_tokens(blocks[: i + 1]) for i in marked if _key(blocks[: i + 1]) in app.state.cache),
            default=0,
        )
        written = 0
        for i in marked:
            prefix = blocks[: i + 1]
            if _key(prefix) not in app.state.cache:
                app.state.cache[_key(prefix)] = _tokens(prefix)
                written = max(written, _tokens(prefix) - read)
        total = _tokens(blocks)
        usage = {
            "input_tokens": total - read - written,
            "output_tokens": 1,
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        }
        return JSONResponse({
            "id": f"msg_{len(app.state.bodies)}", "type": "message", "role": "assistant",
            "model": body["model"], "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn", "stop_sequence": None, "usage": usage,
        })  # fmt: skip

    return app
