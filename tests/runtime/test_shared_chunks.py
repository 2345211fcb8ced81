"""``decode_attention`` over shared prefixes of any length, on every ISA this CPU runs: a row
reading ``shared`` keys from a source row splits its keys there (whole chunks of 256 over the
prefix, the last one partial, then its own keys), rows reading the same chunk of one source row
run as one group; against float64, fp16 K/V bit for bit the fp32 result over the rounded values,
and rows that share nothing bit for bit the call without ``src``."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.kernel_isas import KERNEL_ISAS, isa_kernels
from tests.runtime.test_native_kernels import NEG_INF, reference_attention

# (source row, shared length) per row; a source row points at itself with 0. Rows 0 and 9 are
# sources; row 13 shares nothing and is no source; lengths around the chunk size of 256.
PLAN = [(0, 0), (0, 1), (0, 15), (0, 240), (0, 240), (0, 240), (0, 255), (0, 256), (0, 257),
        (9, 0), (9, 300), (9, 513), (9, 300), (13, 0), (0, 240), (9, 300)]  # fmt: skip


def _rows_sharing(
    head_dim: int, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, src, shared)``: K/V ``[rows, 2, length, head_dim]`` whose row ``b`` holds
    row ``src[b]``'s first ``shared[b]`` positions (PLAN's lengths, at most ``length``; views
    of a buffer with spare capacity)."""
    rows = len(PLAN)
    buffer = torch.randn(2, rows, 2, length + 9, head_dim).to(dtype)
    shared = torch.tensor([n for _, n in PLAN]).clamp(max=length)
    for b, (r, _) in enumerate(PLAN):
        buffer[:, b, :, : shared[b]] = buffer[:, r, :, : shared[b]]
    src = torch.tensor([r for r, _ in PLAN])
    return buffer[0, :, :, :length], buffer[1, :, :, :length], src, shared


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("group", "head_dim", "length"), [(3, 64, 600), (4, 128, 514), (2, 24, 300)]
)
def test_shared_prefixes_of_any_length(
    isa: str, dtype: torch.dtype, group: int, head_dim: int, length: int
) -> None:
    """Shared lengths 1 to 513 from two source rows, several rows at one length (a partial
    chunk run as a group), a masked key inside a shared prefix (that row's chunk runs alone),
    masked tails on a reader, a source and a row of its own; a head dim no group takes (24)."""
    kernels = isa_kernels(isa)
    torch.manual_seed(group * 1000 + head_dim + length)
    k, v, src, shared = _rows_sharing(head_dim, length, dtype)
    q = torch.randn(len(PLAN), 2 * group, head_dim)
    mask = torch.zeros(len(PLAN), length)
    mask[4, 100] = NEG_INF  # inside the prefix a group of 240 shares
    mask[5, 280:] = NEG_INF
    mask[9, length - 40 :] = NEG_INF
    mask[13, 7:30] = NEG_INF
    scale = head_dim**-0.5
    for m in (None, mask):
        got = kernels.decode_attention(q, k, v, m, scale, src, shared)
        want = reference_attention(q, k.float(), v.float(), m, scale)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
        if dtype == torch.float16:
            fp32 = kernels.decode_attention(q, k.float(), v.float(), m, scale, src, shared)
            assert torch.equal(got, fp32)
        plain = kernels.decode_attention(q, k, v, m, scale)
        assert torch.equal(got[13], plain[13])  # shares nothing: the plain blocks, bit for bit


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_a_partial_shared_chunk_is_read_from_the_source_row(isa: str) -> None:
    """Declared over rows that differ, every row's keys ``[0, shared)`` come from its source
    row, the last partial chunk included, and its keys from ``shared`` on from its own row."""
    kernels = isa_kernels(isa)
    torch.manual_seed(3)
    k, v, src, shared = _rows_sharing(64, 600, torch.float32)
    k, v = torch.randn_like(k), torch.randn_like(v)  # NOTE: nothing really shared
    q = torch.randn(len(PLAN), 6, 64)
    got = kernels.decode_attention(q, k, v, None, 0.125, src, shared)
    mixed_k, mixed_v = k.clone(), v.clone()
    for b, (r, n) in enumerate(PLAN):
        mixed_k[b, :, :n], mixed_v[b, :, :n] = k[r, :, :n], v[r, :, :n]  # NOTE: all n < 600
    want = reference_attention(q, mixed_k, mixed_v, None, 0.125)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    plain = kernels.decode_attention(q, k, v, None, 0.125)
    assert (got[4] - plain[4]).abs().max().item() > 1e-2  # [0, 240) is not its own


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_one_row_and_rows_sharing_nothing_keep_the_plain_blocks(
    isa: str, dtype: torch.dtype
) -> None:
    """A decode step of one row, or rows that all share nothing, give the call without ``src``
    bit for bit (the same blocks of 256 keys and the same arithmetic)."""
    kernels = isa_kernels(isa)
    torch.manual_seed(11)
    k, v = torch.randn(2, 3, 2, 771, 64).to(dtype).unbind(0)
    q = torch.randn(3, 6, 64)
    mask = torch.zeros(3, 771)
    mask[1, 500:] = NEG_INF
    for m in (None, mask):
        plain = kernels.decode_attention(q, k, v, m, 0.125)
        alone = torch.arange(3)
        got = kernels.decode_attention(q, k, v, m, 0.125, alone, torch.zeros(3, dtype=torch.long))
        assert torch.equal(got, plain)
        first = None if m is None else m[:1]
        zero = torch.zeros(1, dtype=torch.long)
        one = kernels.decode_attention(q[:1], k[:1], v[:1], first, 0.125, zero, zero)
        assert torch.equal(one, kernels.decode_attention(q[:1], k[:1], v[:1], first, 0.125))
