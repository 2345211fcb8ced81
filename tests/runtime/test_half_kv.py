"""The native kernels over a 16-bit (IEEE fp16) KV cache, on every ISA this CPU runs: a float16
buffer holds K/V rounded to nearest even (torch's ``x.half()``) and every kernel attends over
exactly those values in fp32, so its result equals, bit for bit, the same kernel's over fp32 K/V
holding the rounded values; the decode layer loop stores the new K/V rounded as torch rounds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.model.attention import StepSlots
from runtime.model.compact_llama import CompactLlama
from tests.runtime.kernel_isas import KERNEL_ISAS, isa_kernels
from tests.runtime.test_native_kernels import NEG_INF, _model, reference_attention


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("group", "head_dim", "length"),
    [(3, 64, 2001), (1, 64, 256), (4, 128, 257), (7, 40, 300), (2, 8, 1)],
)
def test_half_decode_attention_is_the_fp32_result_over_rounded_kv(
    isa: str, group: int, head_dim: int, length: int
) -> None:
    """Strided fp16 views of a slot buffer, three rows (one shorter, one with a masked hole of
    a whole block), with and without the mask: equal to the fp32 kernel on ``k.half().float()``
    and, against float64, as accurate as the fp32 kernel."""
    kernels = isa_kernels(isa)
    torch.manual_seed(group * 1000 + head_dim + length)
    rows, kv_heads, capacity = 3, 2, length + 37
    buffer = torch.randn(2, rows + 1, kv_heads, capacity, head_dim).half()  # NOTE: a spare row
    k, v = buffer[0, :rows, :, :length], buffer[1, :rows, :, :length]
    q = torch.randn(rows, kv_heads * group, head_dim)
    mask = torch.zeros(rows, length)
    mask[1, length // 2 + 1 :] = NEG_INF
    mask[2, 256:512] = NEG_INF
    scale = head_dim**-0.5
    for m in (None, mask):
        got = kernels.decode_attention(q, k, v, m, scale)
        assert got.dtype == torch.float32 and got.shape == (rows, kv_heads * group, head_dim)
        assert torch.equal(got, kernels.decode_attention(q, k.float(), v.float(), m, scale))
        want = reference_attention(q, k.float(), v.float(), m, scale)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(("rows", "group", "head_dim"), [(16, 3, 64), (6, 7, 128), (5, 3, 24)])
def test_half_shared_prefix_groups_are_the_fp32_result(
    isa: str, rows: int, group: int, head_dim: int
) -> None:
    """Rows reading whole blocks of a shared prefix from one source row (run as one group of
    queries; 24 runs no group), a row that declares nothing, a masked key inside a shared block
    and a masked tail: fp16 K/V give the fp32 kernel's result over the rounded values."""
    kernels = isa_kernels(isa)
    torch.manual_seed(rows * 100 + group * 10 + head_dim)
    kv_heads, length, shared = 3, 1100, 1030
    buffer = torch.randn(2, rows, kv_heads, length, head_dim).half()
    buffer[:, 1:, :, :shared] = buffer[:, :1, :, :shared]
    k, v = buffer[0], buffer[1]
    q = torch.randn(rows, kv_heads * group, head_dim)
    mask = torch.zeros(rows, length)
    mask[-1, 300] = NEG_INF
    mask[0, 1050:] = NEG_INF
    src = torch.zeros(rows, dtype=torch.long)
    share = torch.full((rows,), shared)
    share[0] = 0
    src[1], share[1] = 1, 0
    for m in (None, mask):
        got = kernels.decode_attention(q, k, v, m, head_dim**-0.5, src, share)
        fp32 = kernels.decode_attention(q, k.float(), v.float(), m, head_dim**-0.5, src, share)
        assert torch.equal(got, fp32)
        want = reference_attention(q, k.float(), v.float(), m, head_dim**-0.5)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_half_decode_attention_refuses_mixed_dtypes(isa: str) -> None:
    """K and V of one dtype (fp32 or float16) and an fp32 query, or an error naming them."""
    kernels = isa_kernels(isa)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    cases = [(q, k.half(), v), (q, k, v.half()), (q.half(), k.half(), v.half()),
             (q, k.bfloat16(), v.bfloat16())]  # fmt: skip
    for qq, kk, vv in cases:
        with pytest.raises(RuntimeError, match="both fp32 or both float16, not q"):
            kernels.decode_attention(qq, kk, vv, None, 0.25)


def _step(compact: CompactLlama, buffer: torch.Tensor, writer: Any = None) -> torch.Tensor:
    """One decode step of three rows at positions 40, 12, 33 (the C++ loop with ``writer``
    None, else the Python loop over it) -> logits ``[3, 1, vocab]``."""
    ids, positions = torch.tensor([[5], [17], [99]]), torch.tensor([40, 12, 33])
    kv_len = int(positions.max()) + 1
    allowed = (torch.arange(kv_len).unsqueeze(0) <= positions.unsqueeze(1)).view(3, 1, 1, -1)
    if writer is not None:
        return compact.forward(ids, positions.unsqueeze(1), writer, allowed)
    slots = StepSlots(buffer, torch.arange(3), positions, kv_len)
    return compact.forward(ids, positions.unsqueeze(1), None, allowed, slots=slots)  # type: ignore[arg-type]


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("arch", "heads", "kv_heads", "head_dim"),
    [("llama", 9, 3, 64), ("qwen2", 4, 2, 8), ("llama", 10, 2, 128)],
)
def test_layer_loop_over_a_half_buffer(
    isa: str, arch: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    """``DecodeLayers`` over a float16 buffer: the first layer's new K/V are the fp32 buffer
    path's rounded by torch (``.half()``, bit for bit: the same values before rounding); the
    logits and every layer's K/V are the Python loop's whose ``write_kv`` rounds K/V to fp16
    (within float32 rounding, and for K/V one fp16 rounding step); no other slot moves."""
    compact = CompactLlama(_model(arch, heads, kv_heads, head_dim), native=isa_kernels(isa))
    layers, capacity, positions = len(compact.layers), 64, torch.tensor([40, 12, 33])
    torch.manual_seed(heads * 10 + head_dim)
    start = torch.randn(layers, 2, 4, kv_heads, capacity, head_dim).half()  # NOTE: a spare row
    python_kv = start.float()

    def write_rounded(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        python_kv[i, 0][torch.arange(3), :, positions] = k[:, :, 0].half().float()
        python_kv[i, 1][torch.arange(3), :, positions] = v[:, :, 0].half().float()
        return python_kv[i, 0, :3, :, :41], python_kv[i, 1, :3, :, :41]

    want = _step(compact, python_kv, write_rounded)
    fp32_kv, half_kv = start.float(), start.clone()
    _step(compact, fp32_kv)
    got = _step(compact, half_kv)
    assert half_kv.dtype == torch.float16
    written = torch.zeros(start.shape[:5], dtype=torch.bool)
    written[:, :, torch.arange(3), :, positions] = True
    assert torch.equal(half_kv[0][written[0]], fp32_kv[0][written[0]].half())
    assert not torch.equal(fp32_kv[0][written[0]], half_kv[0][written[0]].float())  # rounded
    assert torch.equal(half_kv[~written], start[~written])  # nothing else moved
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(half_kv.float(), python_kv, atol=1e-5, rtol=2**-10)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_layer_loop_refuses_another_buffer_dtype(isa: str) -> None:
    """The C++ layer loop refuses a bfloat16 (or fp64) buffer with an error naming its dtype,
    never a misread (``CompactLlama.forward`` sends such a buffer to its Python loop instead:
    ``NATIVE_KV_DTYPES``)."""
    compact = CompactLlama(_model("llama", 4, 2, 8), native=isa_kernels(isa))
    assert compact._layers_native is not None
    h = torch.randn(3, 1, compact.embed.shape[1])
    cos, sin = compact.rope(h, torch.tensor([[40], [12], [33]]))
    rows, pos = torch.arange(3), torch.tensor([40, 12, 33])
    for dtype in (torch.bfloat16, torch.float64):
        buffer = torch.zeros(len(compact.layers), 2, 3, 2, 64, 8, dtype=dtype)
        with pytest.raises(RuntimeError, match="buffer must be fp32 or float16"):
            compact._layers_native.run(h, cos, sin, buffer, rows, pos, 41, None, None, None)
        assert not buffer.any()
