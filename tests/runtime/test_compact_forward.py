"""The compact Llama-family forward gives the transformers forward's answer, and says where it
does not apply.

Same saved weights, two engines (``forward="compact"`` and ``forward="transformers"``): every
step's logits agree within 1e-4 (fp32) with and without prefix-cache hits, and greedy tokens match
except at near-ties. Batched decode on the compact path is covered by test_batch_exactness.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine import Engine
from tests.conftest import VOCAB_SIZE, save_tiny_model
from tests.runtime.kernel_isas import chosen_kernels
from tests.runtime.test_engine_exactness import assert_same_answer, run

PROMPTS = [
    [(11 * i + 4) % (VOCAB_SIZE - 3) + 3 for i in range(26)],
    [(3 * i + 8) % (VOCAB_SIZE - 3) + 3 for i in range(37)],
    [9, 10, 11],
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compact_matches_transformers(arch: str, tmp_path: Path) -> None:
    path = str(save_tiny_model(arch, tmp_path))
    compact = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, forward="compact")
    reference = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4,
                                       forward="transformers")  # fmt: skip
    assert (compact.forward_path, reference.forward_path) == ("compact", "transformers")
    for ids in PROMPTS:
        ref = run(reference, ids, 8, use_cache=False)
        for use_cache in (False, True, True):  # NOTE: the second cached run hits the prefix.
            got = run(compact, ids, 8, use_cache=use_cache)
            assert_same_answer(ref[:2], got[:2])
    compact.close()
    reference.close()


@pytest.mark.parametrize(("arch", "why"), [("gpt2", "model type"), ("mistral_sliding", "sliding")])
def test_other_models_stay_on_transformers(arch: str, why: str, tmp_path: Path) -> None:
    path = str(save_tiny_model(arch, tmp_path))
    engine = Engine.from_pretrained(path, kv_cache_bytes=1 << 20)
    assert engine.forward_path == "transformers"
    assert engine.runner.path_reason is not None and why in engine.runner.path_reason
    engine.close()
    with pytest.raises(ValueError, match="forward='compact' is not available"):
        Engine.from_pretrained(path, kv_cache_bytes=1 << 20, forward="compact")


BF16_TOL = 1e-2
"""bf16 weights and KV (attention in fp32) vs the fp32 reference: |logit difference| at most 1% of
the step's largest |logit| (and at least 1e-2 absolute). Measured on these 2-layer models: <= 3e-3
with logits of magnitude ~0.4; deeper models accumulate more rounding, hence the margin."""


def assert_close_bf16(ref: tuple[list[int], list[Any]], got: tuple[list[int], list[Any]]) -> None:
    for step, (tok_a, tok_b, la, lb) in enumerate(zip(ref[0], got[0], ref[1], got[1], strict=True)):
        tol = BF16_TOL * max(1.0, la.abs().max().item())
        diff = (la.float() - lb.float()).abs().max().item()
        assert diff <= tol, f"step {step}: bf16 logits differ by {diff:.2e} > {tol:.2e}"
        if tok_a != tok_b:
            top2 = torch.topk(la.float(), 2).values
            assert (top2[0] - top2[1]).item() < 2 * tol, f"step {step}: tokens differ, no near-tie"
            return


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_compact_within_its_tolerance_of_fp32(arch: str, tmp_path: Path) -> None:
    path = str(save_tiny_model(arch, tmp_path))
    reference = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4,
                                       forward="transformers")  # fmt: skip
    bf16 = Engine.from_pretrained(path, kv_cache_bytes=1 << 22, block_size=4, dtype="bfloat16")
    assert bf16.forward_path == "compact" and bf16.runner.dtype == torch.bfloat16
    for ids in PROMPTS:
        ref = run(reference, ids, 8, use_cache=False)
        miss = run(bf16, ids, 8, use_cache=False)
        hit = run(bf16, ids, 8, use_cache=True)
        assert_close_bf16(ref[:2], miss[:2])
        assert_close_bf16(miss[:2], hit[:2])  # the prefix cache within the bf16 tolerance too
    reference.close()
    bf16.close()


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa_over_rows_of_different_lengths(
    dtype: torch.dtype, path: str
) -> None:
    """One query per row (the decode step's torch products, and the C++ kernel) against SDPA
    with expanded KV heads: rows of different lengths under one boolean mask, and the additive
    form of the same mask (the boolean one always takes the torch products)."""
    from runtime.model.compact_llama import CompactLlama

    torch.manual_seed(0)
    self = CompactLlama.__new__(CompactLlama)  # NOTE: ``attend`` reads only these two
    self.scale = 64**-0.5
    self.native = chosen_kernels() if path == "native" else None
    rows, heads, kv_heads, length = 3, 6, 2, 40
    q = torch.randn(rows, heads, 1, 64).to(dtype)
    k = torch.randn(rows, kv_heads, length, 64).to(dtype)
    v = torch.randn(rows, kv_heads, length, 64).to(dtype)
    lengths = torch.tensor([40, 7, 23])
    allowed = (torch.arange(length) < lengths.unsqueeze(1)).view(rows, 1, 1, length)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1),
        attn_mask=allowed, scale=self.scale,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for mask in (allowed, additive):
        got = CompactLlama.attend(self, q, k, v, mask)
        assert got.dtype == dtype and got.shape == (rows, heads, 1, 64)
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_are_stored_once_input_major_and_the_hf_forward_still_reads_them(
    arch: str, tmp_path: Path
) -> None:
    """The compact forward's projections and LM head are transposed views of input-major
    storage, the HF modules (and a tied embedding) read the same storage, and the HF forward of
    the rebound model equals a freshly loaded one."""
    from transformers import AutoModelForCausalLM

    from runtime.model.compact_llama import CompactLlama

    path = save_tiny_model(arch, tmp_path)
    # NOTE: transformers leaves PreTrainedModel.eval unannotated.
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # type: ignore[no-untyped-call]
    fresh = AutoModelForCausalLM.from_pretrained(path).eval()  # type: ignore[no-untyped-call]
    is_tied = model.lm_head.weight is model.model.embed_tokens.weight
    compact = CompactLlama(model)
    layer, attn, mlp = compact.layers[0], model.model.layers[0].self_attn, model.model.layers[0].mlp
    for fused, modules in ((layer.qkv, [attn.q_proj, attn.k_proj, attn.v_proj]),
                           (layer.gate_up, [mlp.gate_proj, mlp.up_proj]),
                           (layer.o, [attn.o_proj]), (layer.down, [mlp.down_proj]),
                           (compact.lm_head, [model.lm_head])):  # fmt: skip
        assert fused.t().is_contiguous() and fused.stride(0) == 1, "not input-major"
        for module in modules:
            assert module.weight.untyped_storage().data_ptr() == (
                fused.untyped_storage().data_ptr()
            ), "an HF module holds its own copy"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == is_tied
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, atol=1e-5, rtol=0)
