"""Packed weight copies for small products: ``weights="bfloat16"`` (linear weights rounded to
bfloat16, activations, KV cache and arithmetic in float32, decode steps reading packed bf16
copies) and ``weights="float32-packed"`` (the weights as loaded plus a packed fp32 copy), both
through ``linear_packed``.

The packed product is checked against a float64 product over the same (for bf16: rounded)
weights for every shape class it has code for; the decode step is shown to read the packed
copies (built beside weights that differ from them, it follows the copies); and an engine's
batched decode, with and without prefix-cache hits, gives the model's own transformers forward
within the suite's float32 tolerance on Llama and Qwen2 (QKV biases)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from runtime.engine import Engine
from runtime.model import compact_llama
from runtime.model.attention import StepSlots, prefill_mask
from runtime.model.batch_kv import BatchKV
from runtime.model.compact_llama import CompactLlama
from runtime.model.kernels import PACKED_COLUMNS, pack_weight
from runtime.model.products import PRODUCTS_ENV
from runtime.model.runner import WeightsDtype, round_weights_bf16
from runtime.serve.cli import _runs
from tests.conftest import ModelShape, save_tiny_model
from tests.runtime.kernel_isas import KERNEL_ISAS, chosen_kernels, isa_kernels
from tests.runtime.test_batch_exactness import assert_matches_full_forward, submit
from tests.runtime.test_compact_forward import PROMPTS, assert_close_bf16
from tests.runtime.test_engine_exactness import run
from tests.runtime.test_native_kernels import _model

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "rows"),
    [(960, 576, 16), (100, 70, 3), (33, 5, 9), (1, 1, 1), (64, 3, 70), (32, 129, 8), (47, 300, 2),
     (40, 64, 12), (70, 33, 25)],
)  # fmt: skip
def test_linear_packed_matches_float64(
    isa: str, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    """Column counts with and without a partial last block of 32, K shorter and longer than the
    kernel's unrolled steps, 1 to 70 rows (whole row tiles of 12, several, and remainders), a
    bias, and a ``[B, q, K]`` input; bf16 against the rounded weights, fp32 against the
    weights."""
    kernels = isa_kernels(isa)
    torch.manual_seed(n * 7 + k + rows)
    weight, bias = torch.randn(n, k), torch.randn(n)
    held = weight.to(dtype).double()
    x = torch.randn(rows, 1, k)
    for b in (None, bias):
        got = kernels.linear_packed(x, pack_weight(weight, dtype), b, n)
        want = F.linear(x.double(), held, None if b is None else b.double())
        assert got.shape == (rows, 1, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5, rtol=1e-5)
    if dtype == torch.bfloat16:  # NOTE: against the unrounded weights it differs
        exact = F.linear(x.double(), weight.double())
        got = kernels.linear_packed(x, pack_weight(weight, dtype), None, n).double()
        assert not torch.allclose(got, exact, atol=0.0, rtol=1e-6)


def test_pack_weight_layout() -> None:
    """fp32 blocks hold columns in order, zero past N; bf16 lines hold the same values rounded,
    in the kernel's widening order (a permutation of the 32 columns); other dtypes refused."""
    weight = torch.randn(40, 7)
    fp32, bf16 = pack_weight(weight, torch.float32), pack_weight(weight, torch.bfloat16)
    assert fp32.shape == bf16.shape == (2, 7, PACKED_COLUMNS) and fp32.is_contiguous()
    assert torch.equal(fp32[0], weight[:32].t()) and torch.equal(fp32[1, :, :8], weight[32:].t())
    assert not fp32[1, :, 8:].any()
    line = bf16[0, 0].float()
    assert not torch.equal(line, weight[:32, 0].to(torch.bfloat16).float())  # permuted
    assert torch.equal(line.sort().values, weight[:32, 0].to(torch.bfloat16).float().sort().values)
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float32"):
        pack_weight(weight, torch.float16)
    for bad in (torch.randn(7), torch.randn(2, 3, 4)):
        with pytest.raises(ValueError, match="weight must be 2-D"):
            pack_weight(bad, torch.float32)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_linear_packed_refuses_bad_input(isa: str) -> None:
    kernels = isa_kernels(isa)
    packed, x = pack_weight(torch.randn(40, 16), torch.bfloat16), torch.randn(3, 16)
    assert packed.shape == (2, 16, 32) and packed.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="x must be fp32"):
        kernels.linear_packed(x.double(), packed, None, 40)
    with pytest.raises(RuntimeError, match="x has 15 inputs, the weight 16"):
        kernels.linear_packed(torch.randn(3, 15), packed, None, 40)
    for n in (0, 32, 65):
        with pytest.raises(RuntimeError, match="does not match 2 packed blocks"):
            kernels.linear_packed(x, packed, None, n)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        kernels.linear_packed(x, packed, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="packed must be contiguous bf16 or fp32"):
        kernels.linear_packed(x, packed.double(), None, 40)
    with pytest.raises(RuntimeError, match="not a 0-dim tensor"):
        kernels.linear_packed(torch.tensor(1.0), packed, None, 40)
    with pytest.raises(RuntimeError, match="K = 0 inputs"):
        kernels.linear_packed(torch.randn(3, 0), pack_weight(torch.randn(40, 0), torch.float32),
                              None, 40)  # fmt: skip
    with pytest.raises(RuntimeError, match="packed must be contiguous bf16 or fp32"):
        kernels.linear_packed(x, packed.transpose(0, 1).contiguous().transpose(0, 1), None, 40)


def _step(compact: CompactLlama, rows: int) -> torch.Tensor:
    """One native decode step of ``rows`` rows (positions 9, 10, ...) over zero K/V."""
    capacity = max(32, 9 + rows)  # NOTE: room for the last row's position (32 rows: 40)
    buffer = torch.zeros(len(compact.layers), 2, rows, compact.num_kv_heads, capacity,
                         compact.head_dim)  # fmt: skip
    pos = torch.arange(9, 9 + rows)
    ids = torch.arange(3, 3 + rows).unsqueeze(1)
    slots = StepSlots(buffer, torch.arange(rows), pos, int(pos.max()) + 1)
    allowed = (torch.arange(slots.kv_len) <= pos.unsqueeze(1)).view(rows, 1, 1, -1)
    return compact.forward(ids, pos.unsqueeze(1), None, allowed, slots=slots)  # type: ignore[arg-type]


def _prefill(compact: CompactLlama, n: int) -> torch.Tensor:
    """The Python path: ``n`` tokens from position 0, no cache, every position's logits."""
    ids, positions = torch.arange(3, 3 + n).unsqueeze(0), torch.arange(n).unsqueeze(0)

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    mask = prefill_mask(0, n, torch.device("cpu"))
    return compact.forward(ids, positions, write, mask, logits_to_keep=n)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_steps_of_few_rows_read_the_packed_copies(
    isa: str, arch: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built so that the packed copies and the fp32 weights differ (bf16: copies of weights that
    were NOT rounded; fp32: the weights rounded in place after packing), a step of at most
    ``PACKED_MAX_ROWS`` rows follows the copies and a larger one the fp32 weights, the LM head
    included; so does a short prefill on the Python path."""
    kernels = isa_kernels(isa)
    if not kernels.is_vectorized:
        pytest.skip("scalar kernels keep no packed copies (test_no_copies_where_nothing_...)")
    monkeypatch.setattr(compact_llama, "PACKED_MAX_ROWS", 2)
    model = _model(arch, 4, 2, 16)
    rounded = copy.deepcopy(model)
    round_weights_bf16(rounded)
    mixed = CompactLlama(copy.deepcopy(model), native=kernels, packed=dtype)
    assert mixed.packed_products and mixed.packed_bytes > 0
    plain, bf16 = CompactLlama(model, native=kernels), CompactLlama(rounded, native=kernels)
    if dtype == torch.float32:
        _round_in_place(mixed)  # NOTE: its fp32 weights now hold bf16 values, its copies do not
        want_copies, want_weights = plain, bf16
    else:
        want_copies, want_weights = bf16, plain
    small, large = _step(mixed, 2), _step(mixed, 3)
    torch.testing.assert_close(small, _step(want_copies, 2), atol=1e-5, rtol=1e-5)
    assert (small - _step(want_weights, 2)).abs().max() > 1e-4
    torch.testing.assert_close(large, _step(want_weights, 3), atol=1e-5, rtol=1e-5)
    assert (large - _step(want_copies, 3)).abs().max() > 1e-4
    # the Python path (prefill, chunk rows) too: a 2-token prefill reads the packed copies
    small, large = _prefill(mixed, 2), _prefill(mixed, 3)
    torch.testing.assert_close(small, _prefill(want_copies, 2), atol=1e-5, rtol=1e-5)
    assert (small - _prefill(want_weights, 2)).abs().max() > 1e-4
    torch.testing.assert_close(large, _prefill(want_weights, 3), atol=1e-5, rtol=1e-5)


def _round_in_place(compact: CompactLlama) -> None:
    """Round a compact forward's fused fp32 weights and LM head in place (not its copies)."""
    for layer in compact.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            w.copy_(w.to(torch.bfloat16))
    compact.lm_head.copy_(compact.lm_head.to(torch.bfloat16))


def tied_model(arch: str) -> Any:
    """A 2-layer model with a tied embedding, hidden 64 (whole blocks of 32), vocab 256."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape: ModelShape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
                         "max_position_embeddings": 512, "tie_word_embeddings": True}  # fmt: skip
    torch.manual_seed(7)
    # NOTE: transformers leaves PreTrainedModel.eval unannotated.
    if arch == "qwen2":  # NOTE: QKV biases
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()  # type: ignore[no-untyped-call]
    return LlamaForCausalLM(LlamaConfig(**shape)).eval()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_packed_frees_the_weights_and_keeps_the_answers(isa: str, arch: str) -> None:
    """With ``packed=torch.float32`` and ``drop_fp32`` the projections, the LM head and the tied
    embedding keep no storage of their own (``meta``, in the model's modules too); the embedding
    rows are the saved ones exactly (read from the head's packed lines), and decode steps, a
    short prefill and one of 130 tokens give the logits of the same copies with the weights
    kept. Without copies (scalar kernels) nothing is dropped."""
    kernels = isa_kernels(isa)
    model = tied_model(arch)
    if not kernels.is_vectorized:
        compact = CompactLlama(model, native=kernels, packed=torch.float32, drop_fp32=True)
        assert not compact.fp32_dropped and not model.lm_head.weight.is_meta
        return
    saved = model.model.embed_tokens.weight.detach().clone()
    kept = CompactLlama(copy.deepcopy(model), native=kernels, packed=torch.float32)
    dropped = CompactLlama(model, native=kernels, packed=torch.float32, drop_fp32=True)
    assert dropped.fp32_dropped and not kept.fp32_dropped and dropped.products_label == ""
    assert model.lm_head.weight.is_meta and model.model.embed_tokens.weight.is_meta
    projections = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    assert len(projections) == 14 and all(p.is_meta for p in projections)
    ids = torch.arange(3, 250).view(13, 19)
    assert torch.equal(dropped.embed_tokens(ids), F.embedding(ids, saved))
    for rows in (1, 3):
        torch.testing.assert_close(_step(dropped, rows), _step(kept, rows), atol=1e-5, rtol=1e-5)
    for n in (5, 130):
        torch.testing.assert_close(_prefill(dropped, n), _prefill(kept, n), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("weights", "label"),
    [("bfloat16", "bfloat16 weights"), ("float32-packed", "float32-packed weights")],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_weights_engine_matches_its_model(
    arch: str, weights: WeightsDtype, label: str, tmp_path: Path
) -> None:
    """Three requests decoded together (a prefix-cache miss, then hits): every step's logits are
    the model's own transformers forward within float32 tolerance. With bfloat16 the model's
    linear weights hold bf16 values and differ from the saved fp32 ones; with float32-packed
    the copies hold the saved ones and the weights as loaded are freed (``meta``: the reference
    is the float32 engine's model), so the weights take the same bytes (none kept with the
    scalar kernels, whose products are slower than torch's: the answer is the same)."""
    vectorized = chosen_kernels().is_vectorized
    path = save_tiny_model(arch, tmp_path)
    engine = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4,
                                    weights=weights)  # fmt: skip
    reference = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4)
    runner = engine.runner
    assert runner.weights == weights and runner.compact is not None
    assert runner.compact.packed_products == vectorized and runner.decode_attention == "native"
    if not vectorized and weights == "float32-packed":
        label = "float32-packed weights unused (scalar kernels)"
    assert f"(float32, {label}, compact forward, native decode attention" in _runs(engine)
    head, saved = runner.model.lm_head.weight, reference.runner.model.lm_head.weight
    weights_of = [(ly.qkv, ly.o, ly.gate_up, ly.down) for ly in runner.compact.layers]
    values = head.numel() + sum(w.numel() for four in weights_of for w in four)
    model = None
    if weights == "bfloat16":
        assert torch.equal(head, head.to(torch.bfloat16).float())
        assert not torch.equal(head, saved)
    elif vectorized:
        freed = [head, *(w for four in weights_of for w in four)]
        assert runner.compact.fp32_dropped and all(w.is_meta for w in freed)
        ref = reference.runner.model
        tied = ref.lm_head.weight is ref.model.embed_tokens.weight
        assert runner.model.model.embed_tokens.weight.is_meta == tied
        model = ref
    else:
        assert torch.equal(head, saved)
    # NOTE: whole blocks of 32 columns, so the copies can exceed the weights by the padding
    held = values * (2 if weights == "bfloat16" else 4) if vectorized else 0
    assert held <= runner.compact.packed_bytes <= held * 1.1
    assert_batched_hits_match(engine, model=model)
    engine.close()
    reference.close()


def assert_batched_hits_match(
    engine: Engine, lengths: tuple[int, ...] = (21, 34, 9), model: Any = None
) -> None:
    """Prompts of ``lengths`` tokens decoded together three times (prefix-cache misses, then
    hits): every step's logits are the engine's model's own transformers forward (or
    ``model``'s, holding the same weights) within float32 tolerance
    (``assert_matches_full_forward``); the decode steps ran all rows at once."""
    runner = engine.runner
    prompts = [[(5 * i + 3) % 90 + 3 for i in range(n)] for n in lengths]
    rows: list[int] = []
    decode = runner.decode

    def spy(token_ids: Sequence[int | None], batch: BatchKV) -> torch.Tensor:
        rows.append(len(token_ids))
        return decode(token_ids, batch)

    runner.decode = spy  # type: ignore[method-assign]
    cached = 0
    for use_cache in (False, True, True):
        engine.scheduler.pause()  # NOTE: all join in one iteration, however fast the loop runs
        try:
            runs = [submit(engine, ids, use_cache=use_cache) for ids in prompts]
        finally:
            engine.scheduler.resume()
        for _, stream in runs:
            list(stream)
        for req, _ in runs:
            assert_matches_full_forward(engine, req, model)
            cached += req.cached_len
    del runner.decode
    assert max(rows) == len(prompts) and cached > 0, (rows, cached)


def test_no_copies_where_nothing_would_read_them(tmp_path: Path) -> None:
    """The scalar kernels (several times slower than torch's products) get no copies, and the
    start line says so; so does a model on the transformers forward."""
    scalar = isa_kernels("scalar")
    for dtype in DTYPES:
        compact = CompactLlama(_model("llama", 4, 2, 16), native=scalar, packed=dtype)
        assert not compact.packed_products and compact.packed_bytes == 0
    runner = SimpleNamespace(weights="float32-packed", compact=compact, dtype=torch.float32,
                             decode_attention="native")  # fmt: skip
    line = _runs(SimpleNamespace(runner=runner, forward_path="compact"))
    assert line == (" (float32, float32-packed weights unused (scalar kernels), compact forward, "
                    "native decode attention)")  # fmt: skip
    path = str(save_tiny_model("llama", tmp_path))
    engine = Engine.from_pretrained(path, forward="transformers", weights="float32-packed")
    assert engine.runner.compact is None
    assert ", float32-packed weights unused (transformers forward), transformers" in _runs(engine)
    engine.close()


def test_float32_packed_without_native_kernels_says_unused(tmp_path: Path) -> None:
    """With the kernels off nothing reads a packed copy, so none is kept, and the start line
    says the option is unused instead of claiming packed weights."""
    path = str(save_tiny_model("llama", tmp_path))
    code = ("import sys; from runtime.engine import Engine; from runtime.serve.cli import _runs; "
            "e = Engine.from_pretrained(sys.argv[1], weights='float32-packed'); "
            "print(e.runner.compact.packed_bytes, _runs(e))")  # fmt: skip
    env = {**os.environ, "AGENTCACHE_NATIVE_KERNELS": "0", PRODUCTS_ENV: "mkl"}
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          env=env, timeout=300, check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == (
        "0  (float32, float32-packed weights unused (no native kernels), compact forward)"
    )


def test_packed_weights_need_a_float32_model(tmp_path: Path) -> None:
    path = str(save_tiny_model("llama", tmp_path))
    for weights in ("bfloat16", "float32-packed"):
        with pytest.raises(ValueError, match=f"weights {weights} needs dtype float32"):
            Engine.from_pretrained(path, dtype="bfloat16", weights=weights)
    with pytest.raises(ValueError, match="weights must be one of .* got 'float16'"):
        Engine.from_pretrained(path, weights="float16")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_weights_within_the_bf16_tolerance_of_the_fp32_model(
    arch: str, tmp_path: Path
) -> None:
    """Against the unrounded float32 model the difference is the weights' rounding: within the
    suite's bf16 tolerance (``BF16_TOL``, 1% of the step's largest logit), tokens equal except
    at near-ties. NOTE: measured on the bundled ``tiny`` (5 prompts, 48 greedy tokens each):
    240 of 240 tokens equal, logit differences 1.8e-3 (median) to 2.7e-3 (max) of the largest."""
    path = str(save_tiny_model(arch, tmp_path))
    fp32 = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4)
    bf16 = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, weights="bfloat16")
    for ids in PROMPTS:
        assert_close_bf16(
            run(fp32, ids, 8, use_cache=False)[:2], run(bf16, ids, 8, use_cache=False)[:2]
        )
    fp32.close()
    bf16.close()
