"""The C++ kernels of the compact forward (``runtime.model.kernels``), on every ISA this CPU runs
(``kernel_isas.py``): the decode attention against a float64 reference over every shape class it
has code for, the prefix attention against torch's flash kernel, and the C++ layer loop against
the Python one (within float32 rounding). The loader: ``test_kernel_build.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.model.attention import StepSlots
from runtime.model.compact_llama import CompactLlama
from tests.conftest import ModelShape
from tests.runtime.kernel_isas import KERNEL_ISAS, isa_kernels

NEG_INF = float("-inf")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, scale: float) -> torch.Tensor:  # fmt: skip
    """float64 softmax(q K^T * scale + mask) V with expanded KV heads: ``[B, H, D]``."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("bhd,bhtd->bht", q.double(), kk) * scale
    if mask is not None:
        scores = scores + mask.double().unsqueeze(1)
    return torch.einsum("bht,bhtd->bhd", torch.softmax(scores, dim=-1), vv)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("group", "head_dim", "length"),
    [(3, 64, 2001), (1, 64, 256), (4, 128, 257), (5, 128, 600), (2, 8, 1), (7, 40, 300)],
)
def test_decode_attention_matches_float64(isa: str, group: int, head_dim: int, length: int) -> None:
    """Strided K/V views of a slot buffer (as a batched step reads them), three rows: one with
    no mask entry, one shorter than the rest, one with a hole covering a whole block of keys;
    head dims with (64, 128) and without an unrolled loop, 1 to 7 queries per KV head."""
    kernels = isa_kernels(isa)
    torch.manual_seed(group * 1000 + head_dim + length)
    rows, kv_heads, capacity = 3, 2, length + 37
    buffer = torch.randn(2, rows + 1, kv_heads, capacity, head_dim)  # NOTE: a spare row
    k, v = buffer[0, :rows, :, :length], buffer[1, :rows, :, :length]
    q = torch.randn(rows, kv_heads * group, head_dim)
    mask = torch.zeros(rows, length)
    mask[1, length // 2 + 1 :] = NEG_INF
    mask[2, 256:512] = NEG_INF
    if length > 1:
        mask[2, 0] = NEG_INF
    scale = head_dim**-0.5
    for m in (None, mask):
        got = kernels.decode_attention(q, k, v, m, scale)
        want = reference_attention(q, k, v, m, scale)
        assert got.shape == (rows, kv_heads * group, head_dim) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_decode_attention_fully_masked_row_is_zeros_and_bad_input_raises(isa: str) -> None:
    """A row with no key to attend to gets zeros (torch's softmax gives NaN) and leaves the
    other rows alone; wrong dtypes and shapes raise instead of reading out of bounds."""
    kernels = isa_kernels(isa)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    mask = torch.zeros(2, 300)
    mask[0] = NEG_INF
    got = kernels.decode_attention(q, k, v, mask, 0.25)
    assert torch.equal(got[0], torch.zeros(4, 16))
    torch.testing.assert_close(
        got[1:].double(), reference_attention(q[1:], k[1:], v[1:], None, 0.25), atol=2e-6, rtol=1e-5
    )
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.decode_attention(q.double(), k, v, None, 0.25)
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        kernels.decode_attention(torch.randn(2, 3, 16), k, v, None, 0.25)
    for bad in (torch.zeros(2, 299), torch.zeros(300, 2)):  # NOTE: [T, B] has B * T elements
        with pytest.raises(RuntimeError, match="additive fp32 \\[B, T\\]"):
            kernels.decode_attention(q, k, v, bad, 0.25)
    with pytest.raises(RuntimeError, match="last dim"):
        kernels.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 0.25)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_shared_prefix_is_read_from_the_source_row(isa: str) -> None:
    """Rows whose keys ``[0, shared)`` copy row 0's: declaring it gives the same numbers as not,
    within float32 rounding (the rows reading a block from row 0 run as one group). Declared
    over rows that differ, the whole blocks inside the shared range are really read from the
    source row, and nothing else is."""
    kernels = isa_kernels(isa)
    torch.manual_seed(7)
    rows, kv_heads, group, d, length, shared = 4, 2, 3, 64, 700, 600
    buffer = torch.randn(2, rows, kv_heads, length + 5, d)
    buffer[:, 1:3, :, :shared] = buffer[:, :1, :, :shared]  # rows 1, 2 copied row 0's prefix
    k, v = buffer[0, :, :, :length], buffer[1, :, :, :length]
    q = torch.randn(rows, kv_heads * group, d)
    mask = torch.zeros(rows, length)
    mask[2, 650:] = NEG_INF  # a shorter row
    src, share = torch.tensor([0, 0, 0, 3]), torch.tensor([0, shared, shared, 0])
    for m in (None, mask):
        plain = kernels.decode_attention(q, k, v, m, 0.125)
        got = kernels.decode_attention(q, k, v, m, 0.125, src, share)
        torch.testing.assert_close(got, plain, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got.double(), reference_attention(q, k, v, m, 0.125),
                                   atol=2e-6, rtol=1e-5)  # fmt: skip
    # row 3 differs from row 0 everywhere: declared as sharing 600 positions, its keys
    # [0, 600) (two whole chunks of 256 and one of 88) come from row 0, [600, 700) from its own
    lied = torch.tensor([0, shared, shared, shared])
    got = kernels.decode_attention(q, k, v, None, 0.125, torch.zeros(rows, dtype=torch.long), lied)
    mixed = buffer.clone()
    mixed[:, 3, :, :shared] = buffer[:, 0, :, :shared]
    want = reference_attention(q, mixed[0, :, :, :length], mixed[1, :, :, :length], None, 0.125)
    plain = kernels.decode_attention(q, k, v, None, 0.125)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert (got[3] - plain[3]).abs().max().item() > 1e-2


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("rows", "group", "head_dim"),
    [(20, 4, 64), (6, 7, 128), (9, 2, 80), (5, 3, 24), (2, 1, 16), (4, 2, 48), (3, 3, 32)],
)
def test_rows_sharing_a_block_run_as_one_group(
    isa: str, rows: int, group: int, head_dim: int
) -> None:
    """Many rows reading whole blocks from one source row, against float64: more queries than
    one pass holds (20 x 4 = 80), head dims of one to eight vectors (a pass takes four) and one
    that no group takes (24), a row that declares nothing (it reads its own keys), a row whose
    mask masks a key of a shared block (it runs alone), and the source row's own masked tail."""
    kernels = isa_kernels(isa)
    torch.manual_seed(rows * 100 + group * 10 + head_dim)
    kv_heads, length, shared = 2, 900, 780
    buffer = torch.randn(2, rows, kv_heads, length, head_dim)
    buffer[:, 1:, :, :shared] = buffer[:, :1, :, :shared]
    k, v = buffer[0], buffer[1]
    q = torch.randn(rows, kv_heads * group, head_dim)
    mask = torch.zeros(rows, length)
    mask[-1, 300] = NEG_INF  # inside a shared block
    mask[0, 850:] = NEG_INF
    src = torch.zeros(rows, dtype=torch.long)
    share = torch.full((rows,), shared)
    share[0] = 0
    if rows > 2:
        src[1], share[1] = 1, 0  # a row that declares nothing
    for m in (None, mask):
        got = kernels.decode_attention(q, k, v, m, head_dim**-0.5, src, share)
        want = reference_attention(q, k, v, m, head_dim**-0.5)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_shared_prefix_arguments_are_checked(isa: str) -> None:
    kernels = isa_kernels(isa)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    ok_src, ok_shared = torch.tensor([0, 0]), torch.tensor([0, 256])
    with pytest.raises(RuntimeError, match="together"):
        kernels.decode_attention(q, k, v, None, 0.25, ok_src, None)
    bad = [(torch.tensor([0, 2]), ok_shared), (torch.tensor([0, -1]), ok_shared),
           (ok_src, torch.tensor([0, 301])), (ok_src, torch.tensor([-1, 0]))]  # fmt: skip
    for src, shared in bad:
        with pytest.raises(RuntimeError, match="name a row"):
            kernels.decode_attention(q, k, v, None, 0.25, src, shared)
    with pytest.raises(RuntimeError, match=r"must be \[B\]"):
        kernels.decode_attention(q, k, v, None, 0.25, torch.tensor([0]), torch.tensor([0]))


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_tensors_off_the_cpu_are_refused_before_any_read(isa: str) -> None:
    """A tensor on another device (a CUDA one would be read from host memory and crash the
    process; the meta device stands in for it here) is refused by name, in both kernels."""
    kernels = isa_kernels(isa)
    q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        kernels.decode_attention(q, k, v, torch.zeros(1, 5, device="meta"), 0.3)
    compact = CompactLlama(_model("llama", 4, 2, 8), native=kernels)
    buffer = torch.zeros(len(compact.layers), 2, 1, 2, 16, 8)
    slots = StepSlots(buffer, torch.tensor([0], device="meta"), torch.tensor([3]), 4)
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        compact.forward(torch.tensor([[3]]), torch.tensor([[3]]), None, None, slots=slots)  # type: ignore[arg-type]


def _model(arch: str, heads: int, kv_heads: int, head_dim: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape: ModelShape = {"hidden_size": heads * head_dim, "intermediate_size": 96,
                         "num_hidden_layers": 3, "num_attention_heads": heads,
                         "num_key_value_heads": kv_heads, "vocab_size": 120,
                         "max_position_embeddings": 512}  # fmt: skip
    torch.manual_seed(heads + kv_heads + head_dim)
    # NOTE: transformers leaves PreTrainedModel.eval unannotated.
    if arch == "qwen2":  # NOTE: QKV biases
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()  # type: ignore[no-untyped-call]
    model = LlamaForCausalLM(LlamaConfig(attention_bias=True, **shape))
    return model.eval()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("arch", "heads", "kv_heads", "head_dim"),
    [("llama", 9, 3, 64), ("qwen2", 4, 2, 8), ("llama", 10, 2, 128), ("qwen2", 2, 2, 24)],
)
def test_layer_loop_in_cpp_equals_the_python_loop(
    isa: str, arch: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    """One batched decode step of three rows at different positions (one with a masked tail):
    ``DecodeLayers`` returns the logits and writes the K/V of the Python loop over ``write_kv``,
    within float32 rounding, and touches no other slot of the buffer."""
    compact = CompactLlama(_model(arch, heads, kv_heads, head_dim), native=isa_kernels(isa))
    layers, rows, capacity = len(compact.layers), 3, 64
    start = torch.randn(layers, 2, rows + 1, kv_heads, capacity, head_dim)
    ids = torch.tensor([[5], [17], [99]])
    positions = torch.tensor([40, 12, 33])
    kv_len = int(positions.max()) + 1
    allowed = (torch.arange(kv_len).unsqueeze(0) <= positions.unsqueeze(1)).view(rows, 1, 1, -1)
    step_rows = torch.arange(rows)

    def python_loop() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = start.clone()

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            buffer[i, 0][step_rows, :, positions] = k[:, :, 0]
            buffer[i, 1][step_rows, :, positions] = v[:, :, 0]
            return buffer[i, 0, :rows, :, :kv_len], buffer[i, 1, :rows, :, :kv_len]

        return compact.forward(ids, positions.unsqueeze(1), write, allowed), buffer

    def cpp_loop() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = start.clone()

        def never(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            raise AssertionError("the C++ loop writes K/V itself")

        slots = StepSlots(buffer, step_rows, positions, kv_len)
        return compact.forward(ids, positions.unsqueeze(1), never, allowed, slots=slots), buffer

    (want, want_kv), (got, got_kv) = python_loop(), cpp_loop()
    assert got.shape == (rows, 1, 120)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)
    written = torch.zeros(start.shape[:5], dtype=torch.bool)
    written[:, :, step_rows, :, positions] = True
    assert torch.equal(got_kv[~written], start[~written])  # nothing else moved


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_layer_loop_refuses_a_row_or_position_outside_the_buffer(isa: str) -> None:
    """A bad slot is an error of that step, never a write past the buffer."""
    compact = CompactLlama(_model("llama", 4, 2, 8), native=isa_kernels(isa))
    buffer = torch.zeros(len(compact.layers), 2, 2, 2, 16, 8)
    ids, allowed = torch.tensor([[3]]), torch.ones(1, 1, 1, 16, dtype=torch.bool)
    for row, pos in ((2, 0), (0, 16), (-1, 0)):
        slots = StepSlots(buffer, torch.tensor([row]), torch.tensor([pos]), 16)
        with pytest.raises(RuntimeError, match="outside the buffer"):
            compact.forward(ids, torch.tensor([[pos]]), None, allowed, slots=slots)  # type: ignore[arg-type]
    assert not buffer.any()


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_layer_loop_refuses_step_rows_that_are_not_buffer_rows_0_to_b(isa: str) -> None:
    """The loop attends step row ``j`` over buffer row ``j``: rows inside the buffer but not
    ``0..B-1`` (here ``[1]``, ``[1, 0]``) are refused before anything is written, where they
    would have written one row's K/V and attended to another's."""
    compact = CompactLlama(_model("llama", 4, 2, 8), native=isa_kernels(isa))
    buffer = torch.zeros(len(compact.layers), 2, 3, 2, 16, 8)
    for rows in ([1], [1, 0]):
        n = len(rows)
        ids, allowed = torch.full((n, 1), 3), torch.ones(n, 1, 1, 16, dtype=torch.bool)
        slots = StepSlots(buffer, torch.tensor(rows), torch.zeros(n, dtype=torch.long), 16)
        with pytest.raises(RuntimeError, match="must be buffer row"):
            compact.forward(ids, torch.zeros(n, 1, dtype=torch.long), None, allowed, slots=slots)  # type: ignore[arg-type]
    assert not buffer.any()


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_layer_loop_checks_hidden_size_and_reads_h_row_major(isa: str) -> None:
    """``DecodeLayers`` is public (``native_kernels().decode_layers``): an ``h`` or a norm weight
    of another hidden size is a RuntimeError, not a read past the weights (a 4M-wide ``h``
    segfaulted), and a permuted ``h`` gives the contiguous one's result (it was read as if
    row-major)."""
    kernels = isa_kernels(isa)
    compact = CompactLlama(_model("llama", 4, 2, 8), native=kernels)
    parts = [list(p) for p in zip(*compact.layers, strict=True)]
    layers = kernels.decode_layers(*parts, 4, 2, 8, compact.eps, compact.scale, [], 0, 1, 0, 0)
    cos, sin = compact.rope(torch.zeros(2, 1, 32), torch.tensor([[3], [5]]))

    def run(h: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros(len(compact.layers), 2, 2, 2, 16, 8)
        out: torch.Tensor = layers.run(
            h, cos, sin, buffer, torch.arange(2), torch.tensor([3, 5]), 6, None
        )
        return out

    with pytest.raises(RuntimeError, match="h has hidden size 64, the weights 32"):
        run(torch.randn(2, 1, 64))
    h = torch.randn(32, 1, 2).transpose(0, 2)  # [2, 1, 32], strides (1, 2, 2)
    assert torch.equal(run(h), run(h.contiguous()))
    parts[0][1] = torch.ones(16)  # layer 1's input norm weight
    with pytest.raises(RuntimeError, match="layer 1 needs fp32 contiguous norm weights"):
        kernels.decode_layers(*parts, 4, 2, 8, compact.eps, compact.scale, [], 0, 1, 0, 0)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("heads", "queries", "keys", "head_dim", "spread"),
    [
        (3, 37, 200, 64, 1.0),
        (2, 61, 130, 16, 1.0),
        (1, 7, 65, 128, 1.0),
        (2, 125, 700, 48, 1.0),
        (3, 1, 1, 64, 1.0),
        (2, 13, 64, 32, 30.0),
    ],
)
def test_prefix_attention_matches_torch_flash(
    isa: str, heads: int, queries: int, keys: int, head_dim: int, spread: float
) -> None:
    """``prefix_attention`` against torch's CPU flash kernel (what the cascade used before):
    outputs and log-sum-exp within float32 rounding, on K/V that are views into a larger cache
    (row strides, an offset), partial key blocks and tiles, and scores large enough (``spread``)
    that an unshifted softmax would overflow."""
    from runtime.model.attention import lse_attention as _lse_attention

    kernels = isa_kernels(isa)
    torch.manual_seed(queries + keys)
    cache = torch.randn(2, heads, keys + 9, head_dim)
    k, v = cache[0, :, 5 : 5 + keys], cache[1, :, 5 : 5 + keys]
    q = torch.randn(heads, queries, head_dim) * spread
    scale = head_dim**-0.5
    out, lse = kernels.prefix_attention(q, k, v, scale)
    want, want_lse = _lse_attention(q[None], k[None], v[None], None, scale)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse[0], atol=1e-4 * spread, rtol=1e-5)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_prefix_attention_refuses_bad_input(isa: str) -> None:
    kernels = isa_kernels(isa)
    q, k = torch.randn(2, 5, 64), torch.randn(2, 9, 64)
    with pytest.raises(RuntimeError, match="multiple of 16 up to 128"):
        kernels.prefix_attention(torch.randn(2, 5, 20), torch.randn(2, 9, 20),
                                 torch.randn(2, 9, 20), 0.1)  # fmt: skip
    with pytest.raises(RuntimeError, match="q must be fp32 and k, v both fp32 or both float16"):
        kernels.prefix_attention(q.bfloat16(), k, k, 0.1)
    with pytest.raises(RuntimeError, match=r"q \[H_kv, M, D\], k and v \[H_kv, S, D\]"):
        kernels.prefix_attention(q, k, torch.randn(2, 8, 64), 0.1)
    with pytest.raises(RuntimeError, match="no keys"):
        kernels.prefix_attention(q, k[:, :0], k[:, :0], 0.1)
    with pytest.raises(RuntimeError, match="v rows must be contiguous"):
        kernels.prefix_attention(q, k, torch.randn(2, 64, 9).transpose(1, 2), 0.1)


def causal_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     past: int) -> torch.Tensor:  # fmt: skip
    """float64 attention of ``q`` ``[H, n, D]`` (tokens at ``[past, past + n)``) to ``keys``,
    ``values`` ``[H_kv, past + n, D]``, token ``j`` seeing keys ``[0, past + j]``."""
    n, seen = q.shape[1], keys.shape[1]
    mask = torch.arange(seen)[None, :] <= torch.arange(n)[:, None] + past  # [n, seen]
    group = q.shape[0] // keys.shape[0]
    kk, vv = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    scores = torch.einsum("hnd,hsd->hns", q.double(), kk) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, NEG_INF)
    return torch.einsum("hns,hsd->hnd", torch.softmax(scores, dim=-1), vv)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "segments"),
    [
        (9, 3, 64, [(256, 17)] * 6 + [(0, 1), (3, 40)]),
        (4, 2, 16, [(0, 1), (0, 61), (130, 2)]),
        (2, 2, 128, [(700, 3)]),
        (6, 2, 48, [(7, 25), (0, 130)]),
    ],
)
def test_segment_attention_writes_and_matches_float64(
    isa: str, heads: int, kv_heads: int, head_dim: int, segments: list[tuple[int, int]]
) -> None:
    """``segment_attention`` (a packed prefill's attention in one call): each segment's new K/V
    land in its own buffer at ``[past, past + length)`` of the given layer and nowhere else, and
    its tokens attend causally to that buffer's keys, within float32 rounding of a float64
    reference, whether the buffer is a standalone ``RequestKVCache`` one or a row view of a
    batch buffer (other strides), with full and partial key blocks and query tiles."""
    kernels = isa_kernels(isa)
    torch.manual_seed(heads * 100 + head_dim + len(segments))
    n_all = sum(n for _, n in segments)
    q = torch.randn(heads, n_all, head_dim)
    k_new, v_new = torch.randn(2, kv_heads, n_all, head_dim)
    batch = torch.randn(3, 2, len(segments), kv_heads, 1000, head_dim)  # [L, 2, R, H_kv, cap, D]
    buffers = [
        batch[:, :, s] if s % 2 else torch.randn(3, 2, kv_heads, p + n + 4, head_dim)
        for s, (p, n) in enumerate(segments)
    ]
    before = [b.clone() for b in buffers]
    out = kernels.segment_attention(q, k_new, v_new, buffers, 1, [p for p, _ in segments],
                                    [n for _, n in segments], head_dim**-0.5)  # fmt: skip
    start = 0
    for (past, n), buf, old in zip(segments, buffers, before, strict=True):
        old[1, 0, :, past : past + n] = k_new[:, start : start + n]
        old[1, 1, :, past : past + n] = v_new[:, start : start + n]
        assert torch.equal(buf, old), "only the segment's new positions of layer 1 change"
        want = causal_reference(q[:, start : start + n], buf[1, 0, :, : past + n],
                                buf[1, 1, :, : past + n], past)  # fmt: skip
        torch.testing.assert_close(out[:, start : start + n].double(), want, atol=2e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_segment_attention_refuses_bad_input(isa: str) -> None:
    kernels = isa_kernels(isa)
    q, kv = torch.randn(4, 6, 16), torch.randn(2, 6, 16)
    buf = torch.zeros(2, 2, 2, 8, 16)
    with pytest.raises(RuntimeError, match="does not fit its buffer of 8 positions"):
        kernels.segment_attention(q, kv, kv, [buf], 0, [3], [6], 0.25)
    with pytest.raises(RuntimeError, match="lengths sum to 5, q has 6 tokens"):
        kernels.segment_attention(q, kv, kv, [buf], 0, [0], [5], 0.25)
    with pytest.raises(RuntimeError, match="layer 2 outside buffer 0"):
        kernels.segment_attention(q, kv, kv, [buf], 2, [0], [6], 0.25)
    with pytest.raises(RuntimeError, match="one buffer, past and length per segment"):
        kernels.segment_attention(q, kv, kv, [buf, buf], 0, [0], [6], 0.25)
    with pytest.raises(RuntimeError, match="multiple of 16 up to 128"):
        kernels.segment_attention(torch.randn(4, 6, 8), torch.randn(2, 6, 8),
                                  torch.randn(2, 6, 8), [torch.zeros(1, 2, 2, 8, 8)], 0, [0],
                                  [6], 0.25)  # fmt: skip
    with pytest.raises(RuntimeError, match="fp32 tensors only"):
        kernels.segment_attention(q.bfloat16(), kv, kv, [buf], 0, [0], [6], 0.25)
    assert not buf.any(), "a refused call writes nothing"
