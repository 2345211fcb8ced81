"""``bench load --llama-server`` without llama-server: scripted servers stand in for both engines
(or for llama-server only, next to the real engine on W1), and the figures come out per round."""

from __future__ import annotations

import argparse
import json
import stat
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.bench._clients import RequestResult, run_phase
from runtime.bench.load import main
from runtime.bench.load_peer import ENGINES, _level_figures, compare_level, peer_prompts
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.runtime.serve.server_fakes import ScriptedEngine

REPO = Path(__file__).resolve().parents[3]

# A stand-in llama-server: this project's server over a scripted engine, on the port it is given.
STAND_IN = f"""\
import sys
sys.path.insert(0, {str(REPO)!r})
args = sys.argv[1:]
open(args[args.index("-m") + 1] + ".argv", "w").write(" ".join(args))
import uvicorn
from runtime.serve.app import create_app
from tests.runtime.serve.server_fakes import ScriptedEngine
app = create_app(ScriptedEngine(["x", "y", "z"], max_context_len=100_000))
uvicorn.run(app, host="127.0.0.1", port=int(args[args.index("--port") + 1]), log_level="warning")
"""


def make_args(**overrides: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"rounds": 3, "max_tokens": 3, "timeout_s": 60.0, **overrides})


def test_both_engines_get_the_same_token_ids_in_alternating_order() -> None:
    engines = {name: ScriptedEngine(["a", "b", "c"]) for name in ENGINES}
    order: list[str] = []

    def phase(url: str, bodies: list[dict[str, Any]], n: int, timeout_s: float) -> Any:
        order.append(names[url])
        return run_phase(url, bodies, n, timeout_s)

    with ServerThread(create_app(engines["agentcache"])) as ours:
        with ServerThread(create_app(engines["llama-server"])) as theirs:
            names = {ours: "agentcache", theirs: "llama-server"}
            prompts = partial(peer_prompts, engines["agentcache"].tokenize, 20)
            urls = dict(zip(ENGINES, (ours, theirs), strict=True))
            level = compare_level(urls, prompts, 2, make_args(), phase)
    seen = {name: sorted(ids for _, ids in engine.seen) for name, engine in engines.items()}
    assert seen["agentcache"] == seen["llama-server"] and len(seen["agentcache"]) == 1 + 2 + 3 * 2
    warm = ["agentcache"] * 2 + ["llama-server"] * 2  # one request, then two at once, each
    assert order == [*warm, *ENGINES, *ENGINES[::-1], *ENGINES]
    for name in ENGINES:
        report = level["engines"][name]
        assert (report["num_requests"], report["output_tokens"]) == (3 * 2, 3 * 2 * 3)
        assert report["hit_rate"] > 0 and report["ttft_p50_s"] is not None
        assert len(level["tokens_per_s"][name]) == 3
    assert level["prompt_tokens"]["agentcache"] == level["prompt_tokens"]["llama-server"]
    assert len(level["ratio_per_round"]) == 3 and level["errors"] == 0


def result(completion_tokens: int) -> RequestResult:
    return RequestResult(0.1, 100, 90, completion_tokens, None, (0.01,))


def test_the_ratio_is_ours_over_theirs_round_by_round() -> None:
    rounds = {
        "agentcache": [([result(16), result(16)], 1.0), ([result(16), result(16)], 2.0)],
        "llama-server": [([result(16), result(16)], 2.0), ([result(16), result(16)], 1.0)],
    }
    level = _level_figures(2, rounds, warm_errors=1)
    assert level["tokens_per_s"] == {"agentcache": [32.0, 16.0], "llama-server": [16.0, 32.0]}
    assert level["ratio_per_round"] == [2.0, 0.5]
    assert level["ratio"] == {"min": 0.5, "median": 1.25, "max": 2.0}
    assert level["engines"]["agentcache"]["tokens_per_s"] == round(64 / 3.0, 2)
    assert level["errors"] == 1


def stand_in(path: Path) -> Path:
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.slow
def test_load_against_a_stand_in_llama_server_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = tmp_path / "w1.gguf"
    gguf.write_text("a GGUF is never read by the stand-in")
    argv = ["--llama-server", str(stand_in(tmp_path / "llama-server")), "--gguf", str(gguf)]
    argv += ["--llama-server-np", "2", "--layers", "1", "--rounds", "2", "--max-tokens", "3"]
    argv += ["--system-words", "10", "--threads", "1", "--in-process-clients", "--json"]
    threads = torch.get_num_threads()
    assert main(argv) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    assert "tok/s agentcache / llama-server per round: min" in out
    level = json.loads(out.strip().splitlines()[-1])["levels"][0]
    assert level["concurrency"] == 2  # the default level is -np
    ours = level["engines"]["agentcache"]
    assert ours["output_tokens"] == 2 * 2 * 3 and ours["num_errors"] == 0  # ignore_eos honoured
    assert level["prompt_tokens"]["agentcache"] == level["prompt_tokens"]["llama-server"]
    seen = (tmp_path / "w1.gguf.argv").read_text().split()
    assert seen[seen.index("-np") + 1] == "2" and seen[-6:] == ["-t", "1", "-tb", "1", "-fa", "off"]
