"""Dependencies run one way: serve -> engine -> cache; the runtime never imports the SDK.

The static check reads every import (typing-only and function-level ones included) with
``scripts/import_graph.py``; the dynamic checks import a layer in a fresh interpreter and look at
what got loaded.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_graph() -> object:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loaded_after(code: str) -> set[str]:
    """Module names loaded by a fresh interpreter after running ``code``."""
    script = f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_no_import_cycle_and_no_upward_import() -> None:
    graph = _import_graph()
    edges = graph.graph()  # type: ignore[attr-defined]
    assert graph.cycles(edges) == []  # type: ignore[attr-defined]
    assert graph.upward(edges) == []  # type: ignore[attr-defined]
    assert graph.forbidden(edges) == []  # type: ignore[attr-defined]


def test_import_graph_sees_a_forbidden_import() -> None:
    graph = _import_graph()
    edges = {
        "runtime.model.runner": {"runtime.cache.prefix_cache", "runtime.exceptions"},
        "runtime.sampling.sampler": {"runtime.model.batch_kv", "runtime.outputs"},
    }
    assert graph.forbidden(edges) == [  # type: ignore[attr-defined]
        ("runtime.model.runner", "runtime.cache.prefix_cache"),
        ("runtime.sampling.sampler", "runtime.model.batch_kv"),
    ]


def test_import_graph_sees_a_cycle_and_an_upward_import() -> None:
    graph = _import_graph()
    edges = {"runtime.cache.a": {"runtime.engine"}, "runtime.engine": {"runtime.cache.a"}}
    assert graph.cycles(edges) == [["runtime.cache.a", "runtime.engine"]]  # type: ignore[attr-defined]
    assert graph.upward(edges) == [("runtime.cache.a", "runtime.engine")]  # type: ignore[attr-defined]


def test_engine_import_loads_no_http_stack_benches_or_sdk() -> None:
    loaded = _loaded_after("import runtime.engine")
    for name in ("fastapi", "uvicorn", "starlette", "runtime.serve", "runtime.bench", "agentcache"):
        assert not {m for m in loaded if m == name or m.startswith(name + ".")}, name


def test_cache_layer_loads_no_engine_modules() -> None:
    loaded = _loaded_after("import runtime.cache.prefix_cache")
    outside = {m for m in loaded if m.startswith("runtime.") and not m.startswith("runtime.cache")}
    assert outside <= {"runtime.exceptions", "runtime.models"}
    assert "transformers" not in loaded


def test_sdk_imports_without_torch() -> None:
    # NOTE: a None entry in sys.modules makes `import torch` raise ImportError, as if not installed.
    code = (
        "import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
        "import agentcache, agentcache.agent, agentcache.backends, agentcache.cache, agentcache.rag"
    )
    loaded = _loaded_after(code)
    assert "agentcache.backends.local" not in loaded


def test_runtime_package_import_loads_no_server_stack_or_torch() -> None:
    loaded = _loaded_after("import runtime, runtime.request, runtime.sampling, runtime.scheduler")
    for name in ("fastapi", "uvicorn", "starlette", "runtime.serve", "torch", "transformers"):
        assert not {m for m in loaded if m == name or m.startswith(name + ".")}, name


def test_the_serve_engine_contract_loads_no_torch() -> None:
    # NOTE: the records serve builds and reads: the request, its chunk spans, params, outputs,
    # the engine's config and the scheduler's stats; none carries a torch type.
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "import runtime.request.spec, runtime.chunks.spans, runtime.outputs, runtime.config\n"
        "import runtime.serve.flags, runtime.scheduler.config, runtime.sampling.params"
    )
    loaded = _loaded_after(code)
    assert "runtime.engine" not in loaded and "runtime.model.runner" not in loaded
