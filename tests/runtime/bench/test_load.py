"""The load script runs end to end against a server (a scripted engine) and reports honestly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.bench.load import _decode_batch, main
from runtime.model.kernels import chosen_isa
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.runtime.serve.server_fakes import ScriptedEngine


def test_load_script_against_a_url_prints_one_json_object_last(
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine = ScriptedEngine(["a", "b", "c"])
    with ServerThread(create_app(engine)) as url:
        argv = ["--url", url, "--concurrency", "2", "3", "--rounds", "2"]
        argv += ["--system-words", "20", "--json"]
        assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["errors"] == 0 and report["ok"] is True
    assert [lv["concurrent"]["num_requests"] for lv in report["levels"]] == [4, 6]
    assert [lv["sequential"]["concurrency"] for lv in report["levels"]] == [1, 1]
    first = report["levels"][0]["concurrent"]
    assert first["output_tokens"] == 4 * 3  # three scripted tokens per request
    assert 0 < first["hit_rate"] < 1  # the shared system prompt is reused, the question is not
    assert first["itl_p99_s"] is not None and first["itl_p99_s"] >= 0  # three chunks: two gaps
    assert report["levels"][0]["unpacked"] is None
    assert first["prompt_tokens"] > first["cached_tokens"] > 0
    assert report["hardware"] is None and report["levels"][0]["floor_ratio"] is None  # remote
    assert engine.num_open == 0


def test_load_script_counts_errors_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(["a"], max_context_len=50)  # every request is too long: 400
    with ServerThread(create_app(engine)) as url:
        assert main(["--url", url, "--concurrency", "2", "--rounds", "1", "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["errors"] == 1 + 2 + 2  # warm-up, concurrent, one by one
    assert "HTTP 400" in report["levels"][0]["concurrent"]["first_error"]


def test_load_script_takes_the_v1_url_says_what_it_cannot_see_and_plots(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    engine = ScriptedEngine(["a", "b"])
    plot = tmp_path / "load.png"
    with ServerThread(create_app(engine)) as url:
        argv = ["--url", url + "/v1/", "--concurrency", "1", "2", "--rounds", "1"]
        assert main([*argv, "--system-words", "10", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "pinned blocks after: n/a (a remote server does not say)" in out
    assert "decode batch: n/a (a remote server does not say)" in out
    assert "None" not in out and "n/a/n/a" not in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--url", "http://127.0.0.1:1"], "cannot reach http://127.0.0.1:1"),
        (["--hf"], "--hf was dropped: transformers' generate_batch sizes its paged KV cache"),
        (["--plot", "out.svg"], "give a .png file name"),
        (["--url", "http://x", "--compare-packed-prefill"], "needs the in-process server"),
        (["--url", "http://x", "--weights", "bfloat16"], "in-process server's weights"),
        (["--model", "/nonexistent/w1"], "no such model directory '/nonexistent/w1'"),
    ],
)
def test_load_script_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], captured.err
    assert "Traceback" not in captured.err


@pytest.mark.slow
def test_load_compares_packed_prefill_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--concurrency", "3", "--rounds", "1", "--max-tokens", "2", "--system-words", "10"]
    threads = torch.get_num_threads()
    argv += ["--threads", "1", "--compare-packed-prefill", "--in-process-clients", "--json"]
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # restored for the rest of this process
    out = capsys.readouterr().out
    assert "3 unpacked:" in out and "packed / unpacked prefill throughput" in out
    report = json.loads(out.strip().splitlines()[-1])
    level = report["levels"][0]
    assert report["threads"] == 1
    assert report["products"]["few"] in ("mkl", "onednn") and report["products"]["reason"]
    assert "fp32 products: " in out
    isa = chosen_isa().isa
    assert report["kernels"]["isa"] == isa and f"native kernels: {isa or 'off'} (" in out
    assert 0 < report["rss_before_mb"] <= level["peak_rss_mb"]
    assert level["unpacked"]["num_requests"] == 3 and level["unpacked"]["num_errors"] == 0
    assert 1 <= level["peak_batch"] <= 3 and 1 <= level["mean_batch"] <= level["peak_batch"]
    assert f"decode batch peak/mean: {level['peak_batch']}/{level['mean_batch']}  " in out
    assert report["hardware"]["gemm_gflops"] > 0 and report["hardware"]["read_gb_s"] > 0
    assert 1 <= level["floor_ratio"] <= 3  # three clients: at most three rows for one's cost
    assert f"{level['floor_ratio']:.2f}x with both paths at the floors" in out


def test_decode_batch_reads_a_phase_from_two_snapshots_of_the_step_counts() -> None:
    # Before: 5 one-row steps. The phase adds 2 steps of 3 rows and 2 of 1 row.
    assert _decode_batch((0, 5, 0, 0), (0, 7, 0, 2)) == (3, 2.0)
    assert _decode_batch((0, 5, 0, 0), (0, 5, 0, 0)) == (0, 0.0)  # no decode step ran
    assert _decode_batch(None, None) == (None, None)  # a remote server does not say


def test_a_level_without_usage_gets_no_floor_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.bench.floors import Hardware, W1Shape
    from runtime.bench.load import _add_floor_ratios

    phase = {"concurrency": 4, "num_requests": 4, "num_errors": 0, "prompt_tokens": 0,
             "cached_tokens": 0, "output_tokens": 8}  # fmt: skip
    failed = {**phase, "num_errors": 4, "prompt_tokens": 0, "output_tokens": 0}
    served = {**phase, "prompt_tokens": 40, "cached_tokens": 20}
    levels = [{"concurrent": c, "throughput_ratio": 1.5, "floor_ratio": None}
              for c in (phase, failed, served)]  # fmt: skip
    _add_floor_ratios(levels, W1Shape(1, 8, 8, 8, 8, 16, 4, 4), Hardware(100.0, 10.0))
    assert [lv["floor_ratio"] is None for lv in levels] == [True, True, False]
    out = capsys.readouterr().out
    assert (
        out.count("no ratio at the floors") == 2
        and "(10 prompt tokens, 5 cached, 2 generated)" in out
    )
