"""Quantized weights (``weights="q8_0"`` / ``"q4_1"``): GGUF's blocks, kept packed.

The blocks are GGUF's own bytes (``quantize_weight`` through ``gguf.quants``; a ``.gguf`` file's
tensors read raw by ``runtime.model.gguf_blocks``, q/k rows un-permuted as transformers does); the
products over them (``linear_quantized``) equal a float64 product over the dequantized values on
every ISA this CPU runs, for the direct register tiles (1-4 rows) and the widened path (more);
decode steps read the blocks; and a quantized engine answers the same with the prefix cache on and
off, as a model of its own (it differs from the fp32 one and says so)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.engine import Engine
from runtime.model import compact_llama
from runtime.model.compact_llama import CompactLlama
from runtime.model.gguf_blocks import gguf_blocks
from runtime.model.kernels import (
    QUANT_FORMATS,
    QUANT_HEAD_FORMAT,
    dequantize_weight,
    quant_format_of,
    quantize_weight,
    repack_q4_1,
    unpack_q4_1,
)
from runtime.model.runner import round_weights_quantized
from runtime.serve.cli import _runs
from tests.conftest import save_tiny_model
from tests.runtime.kernel_isas import KERNEL_ISAS, chosen_kernels, isa_kernels
from tests.runtime.test_engine_exactness import assert_same_answer, run
from tests.runtime.test_native_kernels import _model
from tests.runtime.test_packed_weights import _prefill, _step, tied_model

BYTES = {"q8_0": 34, "q4_1": 20}


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_block_layout_is_ggufs(fmt: str) -> None:
    """Q8_0: fp16 scale then 32 int8; Q4_1: fp16 scale, fp16 minimum, byte j holding weight j
    (low nibble) and 16 + j (high): decoded by hand here, they give ``dequantize_weight``'s
    values, which are the weights within the format's rounding."""
    torch.manual_seed(3)
    weight = torch.randn(3, 64)
    blocks = quantize_weight(weight, fmt)
    assert blocks.shape == (3, 2, BYTES[fmt]) and blocks.dtype == torch.uint8
    raw = blocks.numpy()
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [3, 2, 1]
    if fmt == "q8_0":
        q = raw[..., 2:].view(np.int8).astype(np.float32)
        values = d * q
    else:
        m = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = raw[..., 4:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
        values = d * q + m
    want = torch.from_numpy(values.reshape(3, 64))
    assert torch.equal(dequantize_weight(blocks), want)
    step = (weight.abs().max() / 127) if fmt == "q8_0" else (weight.max() - weight.min()) / 15
    assert (want - weight).abs().max() <= step.item()
    assert quant_format_of(blocks) == fmt


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="multiple of 32, not 48"):
        quantize_weight(torch.randn(4, 48), "q4_1")
    with pytest.raises(ValueError, match="unknown quantized format 'q4_0'; valid: q8_0, q4_1"):
        quantize_weight(torch.randn(4, 64), "q4_0")
    with pytest.raises(ValueError, match="must be 2-D"):
        quantize_weight(torch.randn(64), "q8_0")
    with pytest.raises(ValueError, match="blocks must be uint8"):
        dequantize_weight(torch.zeros(2, 2, 33, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown quantized format"):
        gguf_blocks("unused.gguf", "f16")


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_rounding_is_idempotent(fmt: str) -> None:
    """Blocks of dequantized blocks are the same blocks: a model rounded once (or loaded from a
    GGUF file) rounds to itself, so its kept blocks mean exactly its fp32 weights."""
    torch.manual_seed(5)
    weight = torch.randn(64, 256) * torch.rand(64, 1) * 0.1
    blocks = quantize_weight(weight, fmt)
    assert torch.equal(quantize_weight(dequantize_weight(blocks), fmt), blocks)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize(("n", "k", "rows"), [(96, 160, 1), (33, 64, 4), (70, 576, 16),
                                              (17, 32, 64), (5, 96, 3), (40, 128, 7),
                                              (70, 160, 130), (33, 576, 128),
                                              (9, 224, 2), (20, 1536, 1)])  # fmt: skip
def test_quantized_product_matches_float64(isa: str, fmt: str, n: int, k: int, rows: int) -> None:
    """Odd and even output counts (the 2-output tile's remainder), partial 16-output chunks and
    32-column blocks, 1-4 rows (direct tiles), more (widened) and 128 or more (dequantized
    panels), a bias and a ``[B, q, K]`` input, against float64 over the dequantized weights;
    the packed entry point takes the same blocks; ``dequantize_blocks`` gives the values. Q4_1
    also in the kernel layout (``repack_q4_1``; K of 1-48 blocks: whole groups of 4 and 1-3
    blocks past them), equal to the GGUF layout's product within float32 rounding."""
    kernels = isa_kernels(isa)
    torch.manual_seed(n + k + rows)
    weight, bias = torch.randn(n, k), torch.randn(n)
    blocks = quantize_weight(weight, fmt)
    held = dequantize_weight(blocks).double()
    x = torch.randn(rows, 1, k)
    layouts = [blocks, repack_q4_1(blocks)] if fmt == "q4_1" else [blocks]
    results = []
    for layout in layouts:
        for b in (None, bias):
            got = kernels.linear_quantized(x, layout, b)
            want = F.linear(x.double(), held, None if b is None else b.double())
            assert got.shape == (rows, 1, n) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5, rtol=1e-5)
        torch.testing.assert_close(kernels.linear_packed(x, layout, bias, n), got)
        assert torch.equal(kernels.dequantize_blocks(layout), held.float())
        results.append(got)
    torch.testing.assert_close(results[-1], results[0], atol=1e-5 * k**0.5, rtol=1e-5)
    # NOTE: the format's rounding is visible: against the unrounded weights it differs
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert not torch.allclose(got.double(), exact, atol=1e-3, rtol=0.0)


@pytest.mark.parametrize("k", [32, 64, 96, 128, 160, 576, 1536])
def test_kernel_layout_moves_bytes_only(k: int) -> None:
    """``repack_q4_1`` keeps every byte (the same size, ``unpack_q4_1`` gives the blocks back)
    and the values (``dequantize_weight`` reads both layouts); scales and minimums lead each row
    and a group's 32-bit lane ``i`` holds GGUF byte ``i`` of 4 consecutive blocks."""
    torch.manual_seed(k)
    blocks = quantize_weight(torch.randn(6, k), "q4_1")
    rows = repack_q4_1(blocks)
    nb = k // 32
    assert rows.shape == (6, nb * 20) and rows.dtype == torch.uint8 and rows.is_contiguous()
    assert torch.equal(unpack_q4_1(rows), blocks)
    assert torch.equal(dequantize_weight(rows), dequantize_weight(blocks))
    assert quant_format_of(rows) == quant_format_of(blocks) == "q4_1"
    assert torch.equal(rows[:, : 2 * nb].view(6, nb, 2), blocks[:, :, 0:2])
    assert torch.equal(rows[:, 2 * nb : 4 * nb].view(6, nb, 2), blocks[:, :, 2:4])
    if nb >= 4:  # byte 4 i + j of the first group: block j's byte i
        group = rows[:, 4 * nb : 4 * nb + 64].view(6, 16, 4)
        assert torch.equal(group.transpose(1, 2), blocks[:, :4, 4:])
    with pytest.raises(ValueError, match="repack_q4_1: blocks must be uint8"):
        repack_q4_1(quantize_weight(torch.randn(2, 64), "q8_0"))
    with pytest.raises(ValueError, match="unpack_q4_1: rows must be uint8"):
        unpack_q4_1(rows[:, :-1])


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_quantized_product_refuses_bad_blocks(isa: str) -> None:
    kernels = isa_kernels(isa)
    blocks, x = quantize_weight(torch.randn(8, 64), "q4_1"), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        kernels.linear_quantized(x, blocks[..., :19].contiguous(), None)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        kernels.linear_quantized(x, blocks.float(), None)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        kernels.linear_quantized(x, blocks.transpose(0, 1), None)
    with pytest.raises(RuntimeError, match="x has 63 inputs, the weight 64"):
        kernels.linear_quantized(torch.randn(2, 63), blocks, None)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        kernels.linear_quantized(x.double(), blocks, None)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        kernels.linear_quantized(x, blocks, torch.randn(7))
    with pytest.raises(RuntimeError, match="does not match the quantized weight's 8 rows"):
        kernels.linear_packed(x, blocks, None, 9)
    rows = repack_q4_1(blocks)  # [8, 40]: K = 64
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        kernels.linear_quantized(x, rows[:, :39].contiguous(), None)
    with pytest.raises(RuntimeError, match="x has 63 inputs, the weight 64"):
        kernels.linear_quantized(torch.randn(2, 63), rows, None)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_decode_steps_read_the_blocks(isa: str, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built over fp32 weights that were NOT rounded, the compact forward's blocks and its fp32
    weights differ: a step of at most ``PACKED_MAX_ROWS`` rows (the C++ layer loop) and a short
    prefill (the Python path) follow the blocks, i.e. the rounded model; larger ones the fp32
    weights."""
    kernels = isa_kernels(isa)
    if not kernels.is_vectorized:
        pytest.skip("scalar kernels keep no blocks (their products are slower than torch's)")
    monkeypatch.setattr(compact_llama, "PACKED_MAX_ROWS", 2)
    model = _model("llama", 2, 1, 32)  # hidden 64: whole blocks of 32
    rounded = copy.deepcopy(model)
    round_weights_quantized(rounded, fmt)  # type: ignore[arg-type]
    mixed = CompactLlama(copy.deepcopy(model), native=kernels, packed=fmt)
    plain, quant = CompactLlama(model, native=kernels), CompactLlama(rounded, native=kernels)
    assert mixed.packed_products
    small, large = _step(mixed, 2), _step(mixed, 3)
    torch.testing.assert_close(small, _step(quant, 2), atol=1e-5, rtol=1e-5)
    assert (small - _step(plain, 2)).abs().max() > 1e-4
    torch.testing.assert_close(large, _step(plain, 3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_prefill(mixed, 2), _prefill(quant, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drop_fp32_frees_the_weights_and_keeps_the_answers(isa: str, fmt: str, arch: str) -> None:
    """With ``drop_fp32`` the projections, the LM head and the tied embedding keep no fp32
    storage (``meta`` tensors, in the model's modules too); decode steps, a short prefill and
    one of 130 tokens (the dequantized panels) give the logits of the same blocks with the fp32
    copies kept, and the embedding rows come exactly from the head's Q8_0 blocks. Without
    blocks (scalar kernels) nothing is dropped."""
    kernels = isa_kernels(isa)
    model = tied_model(arch)
    round_weights_quantized(model, fmt)  # type: ignore[arg-type]
    if not kernels.is_vectorized:
        compact = CompactLlama(model, native=kernels, packed=fmt, drop_fp32=True)
        assert not compact.fp32_dropped and not model.lm_head.weight.is_meta
        return
    kept = CompactLlama(copy.deepcopy(model), native=kernels, packed=fmt)
    dropped = CompactLlama(model, native=kernels, packed=fmt, drop_fp32=True)
    assert dropped.fp32_dropped and not kept.fp32_dropped
    assert model.lm_head.weight.is_meta and model.model.embed_tokens.weight.is_meta
    projections = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    assert len(projections) == 14 and all(p.is_meta for p in projections)
    assert not any(p.is_meta for n, p in model.named_parameters() if "norm" in n)
    ids = torch.arange(3, 250).view(13, 19)
    assert torch.equal(dropped.embed_tokens(ids), kept.embed_tokens(ids))
    for rows in (1, 3):
        torch.testing.assert_close(_step(dropped, rows), _step(kept, rows), atol=1e-5, rtol=1e-5)
    for n in (5, 130):
        torch.testing.assert_close(_prefill(dropped, n), _prefill(kept, n), atol=1e-4, rtol=1e-4)


def _tiny(arch: str, tmp_path: Path) -> str:
    """The suite's tiny model widened to whole blocks of 32 (hidden 64, MLP 128; 4 heads of 16,
    a head dim the native prefill attention takes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = save_tiny_model(arch, tmp_path)
    config = AutoConfig.from_pretrained(path)
    config.hidden_size, config.intermediate_size = 64, 128
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(1)
    # NOTE: transformers leaves from_config unannotated.
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    return str(path)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_engine_cache_on_equals_off(arch: str, fmt: str, tmp_path: Path) -> None:
    """A quantized engine answers the same with and without prefix-cache hits, token for token;
    its linear weights hold the blocks' values (head in ``QUANT_HEAD_FORMAT``) and its start line
    says which; it is another model than the fp32 one (logits differ)."""
    path = _tiny(arch, tmp_path)
    engine = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, weights=fmt)
    fp32 = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4)
    assert engine.weights == fmt
    label = f", {fmt} weights" if chosen_kernels().is_vectorized else f", {fmt} weights (blocks"
    assert label in _runs(engine)
    head_fmt = QUANT_HEAD_FORMAT[fmt]  # type: ignore[index]
    compact = engine.runner.compact
    if compact is not None and compact.fp32_dropped:  # NOTE: only the blocks hold the head
        want = quantize_weight(fp32.runner.model.lm_head.weight, head_fmt)
        assert torch.equal(compact._head_packed, want)  # type: ignore[arg-type]
        assert engine.runner.model.lm_head.weight.is_meta
    else:
        head = engine.runner.model.lm_head.weight
        assert torch.equal(dequantize_weight(quantize_weight(head, head_fmt)), head)
    assert engine.kv_dtype == "float32"  # NOTE: an fp16 KV cache is opt-in (test_kv_dtype)
    ids = [(11 * i + 5) % 90 + 3 for i in range(37)]
    run(engine, ids[:20], 1, use_cache=True)  # warm the cache with a prefix
    miss = run(engine, ids, 8, use_cache=False)
    hit = run(engine, ids, 8, use_cache=True)
    assert hit[2] > 0
    assert_same_answer(miss[:2], hit[:2])
    engine.check_integrity()
    ref = run(fp32, ids, 8, use_cache=False)
    assert (ref[1][0] - miss[1][0]).abs().max() > 1e-4
    engine.close()
    fp32.close()


def test_quantization_needs_whole_blocks(tmp_path: Path) -> None:
    """The suite's tiny model (hidden 32, MLP 64) quantizes; one with K = 48 is refused naming
    the layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = save_tiny_model("llama", tmp_path)
    config = AutoConfig.from_pretrained(path)
    config.intermediate_size = 48
    # NOTE: transformers leaves from_config unannotated.
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.down_proj: .*"
                                         r"multiple of 32, not 48"):  # fmt: skip
        Engine.from_pretrained(str(path), weights="q4_1")


def _write_gguf(model: object, path: Path, fmt: str) -> None:
    """A minimal GGUF of ``model``'s linear weights as llama.cpp's converter writes them: q and
    k rows permuted for its RoPE (``convert_hf_to_gguf.py``'s LlamaModel.permute), layers in
    ``fmt``, the tied embedding in ``QUANT_HEAD_FORMAT``'s format."""
    from gguf import GGMLQuantizationType, GGUFWriter

    config = model.config  # type: ignore[attr-defined]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    kinds = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}
    head_fmt = QUANT_HEAD_FORMAT[fmt]  # type: ignore[index]
    embed = model.model.embed_tokens.weight.detach()  # type: ignore[attr-defined]
    writer.add_tensor("token_embd.weight", quantize_weight(embed, head_fmt).reshape(
        embed.shape[0], -1).numpy(), raw_dtype=kinds[head_fmt])  # fmt: skip
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip
    for i, layer in enumerate(model.model.layers):  # type: ignore[attr-defined]
        for module in (*layer.self_attn.children(), *layer.mlp.children()):
            name = next(n for n, m in (*layer.self_attn.named_children(),
                                       *layer.mlp.named_children()) if m is module)  # fmt: skip
            if name not in names:
                continue
            w = module.weight.detach()
            if name in ("q_proj", "k_proj"):  # NOTE: the converter's permute, written out
                n_head = heads if name == "q_proj" else kv_heads
                w = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                w = w.swapaxes(1, 2).reshape(module.weight.shape)
            data = quantize_weight(w, fmt).reshape(w.shape[0], -1).numpy()
            writer.add_tensor(f"blk.{i}.{names[name]}.weight", data, raw_dtype=kinds[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_gguf_blocks_are_the_files_own(fmt: str, tmp_path: Path) -> None:
    """Blocks read from a GGUF (q/k rows permuted there, as llama.cpp's converter writes them)
    equal ``quantize_weight`` of the weights they dequantize to, module by module (the
    requantize identity), with q/k un-permuted; and a compact forward given them keeps them."""
    model = _model("llama", 4, 2, 16)
    round_weights_quantized(model, fmt)  # type: ignore[arg-type]
    _write_gguf(model, tmp_path / "m.gguf", fmt)
    blocks = gguf_blocks(tmp_path / "m.gguf", fmt)
    layer = model.model.layers[1]
    assert set(blocks) >= {"model.embed_tokens", "model.layers.1.self_attn.q_proj"}
    for name, module in (("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                         ("down_proj", layer.mlp.down_proj)):  # fmt: skip
        key = f"model.layers.1.{'mlp' if name == 'down_proj' else 'self_attn'}.{name}"
        assert torch.equal(blocks[key], quantize_weight(module.weight, fmt)), name
        assert torch.equal(dequantize_weight(blocks[key]), module.weight.detach()), name
    kernels = chosen_kernels()
    if kernels.is_vectorized:
        compact = CompactLlama(model, native=kernels, packed=fmt, blocks=blocks)
        qkv = compact._packed[4]
        want = torch.cat([blocks[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv"])
        # NOTE: on AVX-512 Q4_1 is kept in the kernel layout, the file's bytes moved in each row
        is_repacked = fmt == "q4_1" and kernels.isa == "avx512"
        assert qkv.dim() == (2 if is_repacked else 3)
        assert torch.equal(unpack_q4_1(qkv) if is_repacked else qkv, want)
        # NOTE: the head is untied here: the file's embedding blocks are not its blocks
        head = quantize_weight(model.lm_head.weight, QUANT_HEAD_FORMAT[fmt])  # type: ignore[index]
        assert torch.equal(compact._head_packed, head)  # type: ignore[arg-type]
        assert not torch.equal(head, blocks["model.embed_tokens"])


def test_server_labels_a_quantized_model(tmp_path: Path) -> None:
    """``/v1/models`` names the weights and every completion carries ``X-Agentcache-Weights``
    (a quantized model answers as another model than its fp32 original)."""
    import httpx

    from runtime.serve.app import WEIGHTS_HEADER, create_app
    from runtime.serve.server_thread import ServerThread

    engine = Engine.from_pretrained(_tiny("llama", tmp_path), weights="q8_0")
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["weights"] == "q8_0" and card["kv_cache_dtype"] == engine.kv_dtype
        body = {"model": engine.model_id, "prompt": "abc", "max_tokens": 2}
        for stream in (False, True):
            resp = client.post("/v1/completions", json={**body, "stream": stream})
            assert resp.status_code == 200 and resp.headers[WEIGHTS_HEADER] == "q8_0"
    engine.close()
