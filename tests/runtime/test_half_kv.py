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


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("heads", "queries", "keys", "head_dim"), [(3, 37, 200, 64), (2, 61, 130, 16), (1, 7, 65, 128)]
)
def test_half_prefix_attention_is_the_fp32_result_over_rounded_kv(
    isa: str, heads: int, queries: int, keys: int, head_dim: int
) -> None:
    """The cascade's shared prefix over fp16 K/V (views into a larger cache): outputs and
    log-sum-exp equal the fp32 kernel's on ``k.half().float()``; mixed dtypes are refused."""
    kernels = isa_kernels(isa)
    torch.manual_seed(queries + keys)
    cache = torch.randn(2, heads, keys + 9, head_dim).half()
    k, v = cache[0, :, 5 : 5 + keys], cache[1, :, 5 : 5 + keys]
    q = torch.randn(heads, queries, head_dim)
    out, lse = kernels.prefix_attention(q, k, v, head_dim**-0.5)
    want, want_lse = kernels.prefix_attention(q, k.float(), v.float(), head_dim**-0.5)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(RuntimeError, match="both fp32 or both float16, not q"):
        kernels.prefix_attention(q, k, v.float(), head_dim**-0.5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "segments"),
    [(9, 3, 64, [(256, 17), (0, 5), (40, 1)]), (4, 2, 16, [(0, 1), (100, 70)]),
     (2, 2, 128, [(300, 2), (3, 33)])],
)  # fmt: skip
def test_half_segment_attention_writes_rounded_kv_and_reads_it_back(
    isa: str, heads: int, kv_heads: int, head_dim: int, segments: list[tuple[int, int]]
) -> None:
    """A packed prefill over float16 buffers (standalone ones and row views of a batch buffer):
    each segment's new K/V are stored as torch rounds them (``.half()``, bit for bit) and
    nowhere else, and its tokens attend to the stored, rounded keys, its own new ones included:
    the result is the fp32 kernel's, bit for bit, given the rounded new K/V over fp32 buffers
    holding the same values (and not the result over the unrounded new K/V)."""
    kernels = isa_kernels(isa)
    torch.manual_seed(heads * 100 + head_dim + len(segments))
    n_all = sum(n for _, n in segments)
    q = torch.randn(heads, n_all, head_dim)
    k_new, v_new = torch.randn(2, kv_heads, n_all, head_dim)
    batch = torch.randn(3, 2, len(segments), kv_heads, 500, head_dim).half()
    halves = [
        batch[:, :, s] if s % 2 else torch.randn(3, 2, kv_heads, p + n + 4, head_dim).half()
        for s, (p, n) in enumerate(segments)
    ]
    before = [b.clone() for b in halves]
    floats = [b.float() for b in halves]
    past, lengths = [p for p, _ in segments], [n for _, n in segments]
    got = kernels.segment_attention(q, k_new, v_new, halves, 1, past, lengths, head_dim**-0.5)
    rounded = kernels.segment_attention(q, k_new.half().float(), v_new.half().float(), floats, 1,
                                        past, lengths, head_dim**-0.5)  # fmt: skip
    assert torch.equal(got, rounded)
    unrounded = kernels.segment_attention(q, k_new, v_new, [b.float() for b in before], 1, past,
                                          lengths, head_dim**-0.5)  # fmt: skip
    assert not torch.equal(got, unrounded)
    start = 0
    for (p, n), buf, old in zip(segments, halves, before, strict=True):
        old[1, 0, :, p : p + n] = k_new[:, start : start + n].half()
        old[1, 1, :, p : p + n] = v_new[:, start : start + n].half()
        assert torch.equal(buf, old), "the segment's new positions of layer 1, rounded, only"
        start += n


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_half_segment_attention_refuses_mixed_buffers(isa: str) -> None:
    """Every buffer of one dtype, fp32 or float16, or an error naming them; nothing written."""
    kernels = isa_kernels(isa)
    q, k_new, v_new = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    for first, second in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        buffers = [
            torch.zeros(1, 2, 2, 8, 16, dtype=first),
            torch.zeros(1, 2, 2, 8, 16, dtype=second),
        ]
        with pytest.raises(RuntimeError, match="fp32 or float16 as every buffer"):
            kernels.segment_attention(q, k_new, v_new, buffers, 0, [0, 0], [2, 1], 0.25)
        assert not any(b.any() for b in buffers)
