"""Benchmark command lines reject counts below one with a usage error (exit 2), not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.bench import _weights_pair as weights_pair
from runtime.bench import choices, prefix, rag, stall, trace
from runtime.bench import load as loadtest
from runtime.bench._common import ttft
from runtime.bench._figures import Spread
from runtime.engine import Engine
from runtime.model.kernels import chosen_isa


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (prefix.prefix_main, ["--repeats", "0"]),
        (prefix.prefix_main, ["--prefix-len", "-5"]),
        (trace.trace_main, ["--system-len", "0"]),
        (trace.trace_main, ["--layers", "x"]),
        (trace.trace_main, ["--agent-seeds", "0"]),
        (loadtest.main, ["--concurrency", "16", "0"]),
        (loadtest.main, ["--rounds", "0"]),
        (rag.main, ["--requests", "0"]),
        (rag.main, ["--doc-len", "x"]),
        (stall.main, ["--long-tokens", "0"]),
    ],
)
def test_non_positive_counts_are_usage_errors(
    main: object, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(main)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "must be at least 1" in err or "expected a whole number" in err


def test_trace_refuses_more_agent_seeds_than_it_has(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        trace.trace_main(["--agent-seeds", "13"])
    assert exc.value.code == 2
    assert "--agent-seeds is at most 12 (seeds 2-13), got 13" in capsys.readouterr().err


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    for main in (prefix.prefix_main, trace.trace_main, loadtest.main, rag.main, stall.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        out = capsys.readouterr().out
        assert "``" not in out and "issue" not in out.lower()


@pytest.mark.slow
def test_trace_prints_a_spread_table_json_and_a_plot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "trace.png"
    argv = ["--layers", "1", "--system-len", "40", "--convs-per-system", "1", "--turn-len", "4"]
    argv += ["--gen-tokens", "1", "--json", "--plot", str(plot), "--agent-seeds", "1"]
    assert trace.trace_main(argv) == 0
    out = capsys.readouterr().out
    assert "median" in out and "hit rate, full" in out and "TTFT per request, off" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ttft_spread"]["ttft_off"]["n"] == 24  # 8 conversations x 3 turns
    assert report["ttft_spread"]["ttft_off"]["unit"] == "ms"
    assert all(f"warning: {w}" in out for w in report["warnings"])  # as printed, or none
    assert 0 < report["full_hit_rate"] < 1
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # one agent-sessions seed (2), every policy at every budget; the default never below LRU
    for budget in ("eighth", "quarter", "half"):
        rates = {p: report[f"agents_{budget}_{p}_hit_rate"]
                 for p in ("lru", "shared", "slru", "adaptive_shared", "adaptive")}  # fmt: skip
        assert rates["adaptive"] >= rates["lru"], (budget, rates)
    assert not any(k.startswith("agents_seed3_") for k in report)


@pytest.mark.slow
def test_prefix_prints_tables_with_units_and_keeps_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--layers", "1", "--prefix-len", "64", "--suffix-len", "4", "--repeats", "2"]
    assert prefix.prefix_main([*argv, "--decode-tokens", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert "hit floor: forward over KV in memory" in out and "tok/s" in out
    assert "3538944.0000" not in out and "=" not in out.split("{")[0]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["spread"]["hit (prefix cached)"]["n"] == 2
    assert "miss_over_hit" in report and isinstance(report["warnings"], list)
    assert report["products"]["few"] in ("mkl", "onednn") and report["products"]["reason"]
    assert "fp32 products: " in out
    # the ISA the kernels run, as chosen here (the header, the JSON and the printed line agree)
    isa = chosen_isa().isa
    assert report["kernels"]["isa"] == isa and report["kernels"]["loaded"] == (isa is not None)
    assert report["kernel_isa"] == (isa or "off")
    assert f"native kernels: {isa or 'off'} (" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compare-weights", "float32"], "--compare-weights float32 equals --weights"),
        (["--compare-weights", "q8_0", "--decode-tokens", "1"], "--decode-tokens 2 or more"),
        (["--compare-weights", "q8_0", "--warm-restart"], "runs alone, not with --warm-restart"),
        (["--compare-weights", "q8_0", "--dtype", "bfloat16"], "needs --dtype float32"),
    ],
)
def test_prefix_compare_weights_refuses_what_it_cannot_run(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prefix.prefix_main(extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_prefix_compare_weights_alternates_two_engines_in_one_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each engine runs the prompt once (warm-up), then the engines take turns, the order
    flipping every round; the table and the JSON give both rates and the per-round ratio."""
    calls: list[tuple[str, int]] = []

    def recording_ttft(eng: Engine, ids: list[int], *, max_tokens: int = 1) -> object:
        calls.append((eng.weights, max_tokens))
        return ttft(eng, ids, max_tokens=max_tokens)

    monkeypatch.setattr(weights_pair, "ttft", recording_ttft)
    argv = ["--layers", "1", "--prefix-len", "16", "--suffix-len", "4", "--repeats", "3"]
    argv += ["--decode-tokens", "3", "--weights", "q8_0", "--compare-weights", "float32", "--json"]
    assert prefix.prefix_main(argv) == 0
    warm = [("q8_0", 1), ("float32", 1)]
    turns = [("q8_0", 3), ("float32", 3), ("float32", 3), ("q8_0", 3), ("q8_0", 3), ("float32", 3)]
    assert calls == warm + turns
    out = capsys.readouterr().out
    assert "q8_0 / float32" in out and "engines taking turns" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["weights"] == "q8_0" and report["compare_weights"] == "float32"
    assert report["spread"]["q8_0"]["n"] == report["spread"]["q8_0 / float32"]["n"] == 3
    assert all(f"warning: {w}" in out for w in report["warnings"])  # as printed, or none
    assert report["decode_tokens_per_s"] > 0 and report["compare_decode_tokens_per_s"] > 0
    low, mid, high = (report[f"decode_ratio_{k}"] for k in ("min", "median", "max"))
    assert 0 < low <= mid <= high


def test_prefix_refuses_bf16_weights_on_a_16_bit_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``--weights bfloat16`` rounds float32 weights: with ``--dtype bfloat16`` it is a usage
    error before anything is built (it was a ValueError traceback from the model's rounding)."""
    for weights in ("bfloat16", "float32-packed"):
        with pytest.raises(SystemExit) as exit_info:
            prefix.prefix_main(["--dtype", "bfloat16", "--weights", weights])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"--weights {weights} needs --dtype float32, not bfloat16" in err
        assert "Traceback" not in err


def test_noise_warnings_name_a_flipping_ratio_and_a_hit_below_its_floor() -> None:
    from runtime.bench._figures import Spread, noise_warnings

    hit = Spread.ms("hit", [0.010, 0.030])
    floor = Spread.ms("floor", [0.012, 0.011])
    flips = Spread("hit / other", "x", (0.8, 1.3))
    warnings = noise_warnings([hit], [flips], [(hit, floor)])
    assert warnings[0] == "hit beat its own floor (floor) in 1 of 2 runs: the machine was noisy"
    assert "hit / other flips between runs (0.80x to 1.30x)" in warnings[1]
    assert "hit varies 3.0x between runs" in warnings[2]
    assert noise_warnings([floor], [Spread("r", "x", (1.2, 1.3))]) == []


@pytest.mark.slow
def test_rag_prints_ttft_per_mode_and_quality(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--layers", "1", "--num-docs", "4", "--doc-len", "24", "--requests", "2"]
    argv += ["--quality-prompts", "1", "--gen-tokens", "3", "--fractions", "0", "100", "--json"]
    assert rag.main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT, exact" in out and "prefix only / blend" in out and "top-1 agreement" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["spread"]["TTFT, no cache"]["n"] == 2
    assert report["no_cache_reused_tokens_mean"] == 0
    assert report["exact_reused_tokens_mean"] >= 4 * 24  # every document from the store
    # Prefix-cached and chunk-reused tokens apart (a 32-token head, 4 documents x 24 tokens per
    # request): the warm-up's entry serves the head and the first document's opening (a hit
    # ending inside it is kept), the store the rest.
    exact_cached = report["exact_cached_tokens_mean"]
    assert exact_cached > 32 and report["exact_chunk_reused_tokens_mean"] + exact_cached == 32 + 96
    assert report["exact_chunk_missed_tokens_mean"] == 0
    blend = report["blend_chunk_reused_tokens_mean"] + report["blend_chunk_recomputed_tokens_mean"]
    assert blend == 4 * 24 and report["blend_chunk_recomputed_tokens_mean"] > 0
    assert report["prefix_only_chunk_reused_tokens_mean"] == 0
    for mode in ("no_cache", "prefix_only", "blend", "exact"):
        cached, chunk = (
            report[f"{mode}_cached_tokens_mean"],
            report[f"{mode}_chunk_reused_tokens_mean"],
        )
        assert report[f"{mode}_reused_tokens_mean"] == cached + chunk
    # The warm-up stored each document once; then 2 requests x 2 modes x 4 documents hit.
    assert {k: report["chunk_store"][k] for k in ("num_misses", "num_hits", "num_entries")} == {
        "num_misses": 4, "num_hits": 16, "num_entries": 4,
    }  # fmt: skip
    # 100% recompute is the causal prefill: same greedy tokens.
    assert report["blend_100pct_top1"] == 1.0 and report["blend_100pct_kl"] < 1e-6
    assert report["exact_vs_masked_max_logit_diff"] < 1e-4


STALL_ARGV = ["--layers", "1", "--streams", "2", "--stream-tokens", "6", "--long", "2"]
STALL_ARGV += ["--long-tokens", "40", "--chunk", "16", "--repeats", "1", "--threads", "1", "--json"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "exact", "blend"])
def test_stall_times_both_engines_and_reports_chunk_usage_under_chunk_reuse(
    mode: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = STALL_ARGV if mode is None else [*STALL_ARGV, "--chunk-reuse", mode]
    assert stall.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spread = report["spread"]
    for engine in ("whole", "chunk16"):
        worst = spread[f"worst gap, {engine}"]  # one round: the streams' gaps were seen
        assert worst["unit"] == "ms" and worst["n"] == 1
        assert 0 < worst["min"] <= worst["median"] <= worst["max"]
        assert spread[f"gaps counted, {engine}"]["min"] >= 1
        assert spread[f"long prompts' TTFT, {engine}"]["min"] > 0
    assert spread["worst gap whole / chunked"]["n"] == 1
    numbers = [v for figure in spread.values() for k, v in figure.items() if k != "unit"]
    assert all(isinstance(v, int | float) for v in numbers)  # numbers, not "a / b / c" strings
    assert isinstance(report["warnings"], list)  # one round: at least "no spread to judge"
    assert any("one run per figure" in w for w in report["warnings"])
    chunk_keys = sorted(k for k in report if "chunk_" in k or k == "chunk reuse")
    if mode is None:  # the plain bench's output is unchanged: no chunk-reuse lines
        assert chunk_keys == []
        return
    # A 40-token prompt: a 1-token head, 4 documents of 8 tokens, each with a separator, a
    # 3-token question. New documents each round: every span token of both long prompts missed
    # the chunk store on both engines, none was reused.
    assert report["chunk reuse"] == f"{mode}, 4 documents x 8 tokens, new each round"
    assert len(chunk_keys) == 5
    for engine in ("whole", "chunk16"):
        assert report[f"{engine} chunk_missed_tokens per long"] == 4 * 8
        assert report[f"{engine} chunk_reused_tokens per long"] == 0


def test_stall_counts_only_the_gaps_overlapping_the_long_prompts_wait() -> None:
    # Two streams' token times (s); the long prompts wait from 1.0 to 3.0. Stream 1's gap
    # 0.9 -> 3.2 overlaps it, 0.5 -> 0.9 ends before and 3.2 -> 3.3 starts after; stream 2 has
    # two gaps inside (1.5 -> 2.0 -> 2.9) and one that straddles its start (0.8 -> 1.5).
    stamps = [[0.5, 0.9, 3.2, 3.3], [0.8, 1.5, 2.0, 2.9]]
    gaps = stall._stalled_gaps(stamps, 1.0, 3.0)
    assert [round(g, 6) for g in gaps] == [2.3, 0.7, 0.5, 0.9]
    assert stall._stalled_gaps([[0.1, 0.2]], 1.0, 3.0) == []  # no gap: worst 0.0, count 0


def test_stall_chunk_reuse_needs_room_for_the_documents(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        stall.main(["--chunk-reuse", "exact", "--long-tokens", "12"])
    assert exc.value.code == 2
    assert "--chunk-reuse needs --long-tokens >= 16" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("free", "bound", "overhead"),
    [
        ((10.0, 11.0, 12.0), (14.0, 15.0, 16.0), 4.0),  # apart: a figure
        ((10.0, 11.0, 12.0), (11.5, 12.0, 16.0), None),  # overlapping: the spread reaches zero
        ((10.0, 11.0, 30.0), (8.0, 9.0, 10.5), None),  # negative at the medians (-2 ms)
        ((12.0,), (11.0,), None),  # one run each, constrained faster
    ],
)
def test_a_grammar_overhead_the_noise_hides_is_a_warning_not_a_figure(
    free: tuple[float, ...], bound: tuple[float, ...], overhead: float | None
) -> None:
    figure, warning = choices.grammar_overhead(
        Spread("free, 1 rows, per token", "ms", free),
        Spread("grammar, 1 rows, per token", "ms", bound),
    )
    assert figure == overhead
    if overhead is None:
        assert warning is not None and "below the noise" in warning and "no overhead" in warning
    else:
        assert warning is None


@pytest.mark.slow
def test_choices_json_has_numbers_a_spread_and_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--layers", "1", "--prompt-len", "16", "--gen-tokens", "2", "--grammar-rows", "2"]
    assert choices.main([*argv, "--repeats", "2", "--threads", "1", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert (
        report["spread"]["n=4, cache on"]["n"] == 2 and report["spread"]["n=4, cache on"]["min"] > 0
    )
    assert report["spread"]["grammar, 2 rows, per token"]["unit"] == "ms"
    assert report["spread"]["4 requests / n=4, cache off"]["unit"] == "x"
    assert isinstance(report["warnings"], list)
    for rows in (1, 2):  # an overhead is a figure, or null with its warning
        overhead = report[f"rows{rows}_grammar_overhead_ms_per_token"]
        hidden = [w for w in report["warnings"] if w.startswith(f"grammar, {rows} rows")]
        assert (overhead is None) == bool(hidden)
        assert overhead is None or overhead > 0
    assert "None" not in out.split("{")[0]


def test_prefix_refuses_a_model_whose_vocabulary_cannot_hold_its_random_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prefix.prefix_main(["--model", "tiny"])
    assert exit_info.value.code == 2
    assert "--model 'tiny': vocabulary of 4096 < 49000 random ids" in capsys.readouterr().err


@pytest.mark.slow
def test_prefix_runs_a_model_folder_in_its_own_shape(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=49152, max_position_embeddings=512,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)  # type: ignore[no-untyped-call]
    argv = ["--model", str(tmp_path), "--prefix-len", "64", "--suffix-len", "4", "--repeats", "2"]
    assert prefix.prefix_main([*argv, "--decode-tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["workload"] == f"model {tmp_path}" and report["layers"] == 2
    assert report["spread"]["hit (prefix cached)"]["n"] == 2
