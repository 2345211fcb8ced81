"""Helpers shared by the engine benchmarks: the W1-shaped random model, a bench engine, timers.

No downloads: models are built from configs. It knows nothing about HTTP or the SDK.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from runtime.config import KVDtype
from runtime.engine import Engine
from runtime.model.runner import (
    ForwardPath,
    WeightsDtype,
    load_model,
    round_weights_bf16,
    round_weights_quantized,
)
from runtime.sampling.params import SamplingParams
from runtime.serve.argtypes import positive_int

__all__ = [
    "NullTokenizer",
    "add_common_options",
    "bench_engine",
    "products_record",
    "report",
    "restores_torch_threads",
    "timed",
    "ttft",
    "w1_model",
]


class NullTokenizer:
    """Stands in for a tokenizer: benchmarks feed token ids and ignore text."""

    eos_token_id = None
    chat_template = None
    model_max_length = 1 << 20

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def w1_model(args: argparse.Namespace, *, model: str | None = None) -> Any:
    """SmolLM2-135M-shaped Llama (W1) with random weights; ``--layers`` scales it down and
    ``--weights bfloat16`` rounds its linear weights (``round_weights_bf16``). With ``model``
    (``bench prefix --model``) that model instead, through the one loader (``load_model``: a
    named model such as ``smollm2-135m`` is pulled on first use); ``--layers`` then does not
    apply."""
    if model:
        from runtime.models import resolve_model

        path = resolve_model(model)
        if path.endswith(".gguf"):
            real, _ = load_model(path, dtype=args.dtype, device="cpu", revision=None)
        else:  # NOTE: the benches feed token ids: a folder without a tokenizer is fine
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
            real = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()  # type: ignore[no-untyped-call]
        if getattr(args, "weights", "float32") == "bfloat16":
            round_weights_bf16(real)
        return real
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=576, num_hidden_layers=args.layers, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()  # type: ignore[no-untyped-call]
    if getattr(args, "weights", "float32") == "bfloat16":  # NOTE: the peers see the same weights
        round_weights_bf16(model)
    return model


def restores_torch_threads(main: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """``main`` (a bench's entry point, which ``--threads`` lets set torch's thread count)
    leaves torch's thread count as it found it: it also runs inside other programs (the test
    suite, where a bench test's ``--threads 1`` once left every later test on one thread)."""

    @functools.wraps(main)
    def wrapper(argv: list[str]) -> int:
        threads = torch.get_num_threads()
        try:
            return main(argv)
        finally:
            torch.set_num_threads(threads)

    return wrapper


def products_record(engine: Engine) -> tuple[str | None, dict[str, str] | None]:
    """``engine``'s fp32 products for a bench's report: the line to print (``"fp32 products:
    oneDNN products (measured: ...)"``) and the ``ProductChoice`` as JSON, both None where the
    engine runs no compact fp32 forward (``ModelRunner.products`` is None)."""
    products, compact = engine.runner.products, engine.runner.compact
    if products is None or compact is None:
        return None, None
    line = f"fp32 products: {compact.products_label or 'MKL'} ({products.reason})"
    return line, products._asdict()


def kernels_record() -> tuple[str, dict[str, str | bool | None]]:
    """The native kernels this process runs, for a bench's header: the line to print
    (``"native kernels: avx2 (native: avx2 (this CPU lacks avx512f, ...))"``) and the same as
    JSON (``isa``: the ISA, None when off; ``loaded``; ``reason``). Builds them if needed."""
    from runtime.model.kernels import chosen_isa, native_status

    choice, status = chosen_isa(), native_status()
    isa = choice.isa if status.loaded else None
    why = choice.reason if status.loaded else status.reason
    return f"native kernels: {isa or 'off'} ({why})", {
        "isa": isa,
        "loaded": status.loaded,
        "reason": why,
    }


def bench_engine(
    model: Any, *, kv_bytes: int, prefix_cache: bool = True, forward: ForwardPath = "auto",
    disk_dir: str | None = None, disk_bytes: int = 0, weights: WeightsDtype = "float32",
    kv_dtype: KVDtype = "auto",
) -> Engine:  # fmt: skip
    disk: dict[str, Any] = {} if disk_dir is None else {"kv_disk_dir": disk_dir,
                                                         "kv_disk_bytes": disk_bytes}  # fmt: skip
    if weights in ("q8_0", "q4_1", "float32-packed"):
        # NOTE: a quantized or float32-packed engine frees its model's fp32 weights
        # (CompactLlama's drop_fp32), while the bench shares ``model`` among engines and its HF
        # reference forwards: each engine gets a copy of the (rounded) model (rounding is
        # idempotent), ``model`` keeps the same values for the references.
        if weights != "float32-packed":
            round_weights_quantized(model, weights)
        model = copy.deepcopy(model)
    return Engine(model, NullTokenizer(), model_id="bench-w1", kv_cache_bytes=kv_bytes,
                  prefix_cache=prefix_cache, forward=forward, weights=weights,
                  kv_dtype=kv_dtype, **disk)  # fmt: skip


def ttft(eng: Engine, ids: list[int], *, use_cache: bool = True, max_tokens: int = 1) -> Any:
    """The Completion of one greedy request that decodes exactly ``max_tokens`` (EOS ignored),
    read as ``Engine.generate`` reads it: only the final delta is posted (as the in-process
    peers, transformers and llama-cpp-python's generator, hand over no stream either)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = eng.make_request(ids, params, use_prefix_cache=use_cache)
    req.is_streamed = False
    return list(eng.run(req))[-1].completion


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def add_common_options(parser: argparse.ArgumentParser, *, layers: int, repeats: int) -> None:
    parser.add_argument("--layers", type=positive_int, default=layers, help="decoder layers")
    parser.add_argument("--repeats", type=positive_int, default=repeats, help="runs per figure")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")


def report(result: dict[str, Any], as_json: bool, header: dict[str, Any]) -> None:
    for key, value in {**header, **result}.items():
        print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
    if as_json:
        print(json.dumps({**header, **result}, sort_keys=True))
