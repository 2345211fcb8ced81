"""The compact forward's fp32 products on MKL or oneDNN (``runtime.model.products``): both are
float32 products, so either gives the model's answers within float32 tolerance; the choice is
made per load (measured, or ``AGENTCACHE_FP32_PRODUCTS``) and every product follows it, the C++
layer loop's included."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.engine import Engine
from runtime.model import products as fp32_products
from runtime.model.compact_llama import CompactLlama
from runtime.model.products import (
    FEW_ROWS,
    MKL_ONLY,
    PRODUCTS_ENV,
    ROWS_MAX,
    ProductChoice,
    choose_prefix_attention,
    choose_products,
    onednn_linear,
    onednn_problem,
)
from runtime.serve.cli import _runs
from tests.conftest import save_tiny_model
from tests.runtime.kernel_isas import KERNEL_ISAS, chosen_kernels, isa_kernels
from tests.runtime.test_native_kernels import _model
from tests.runtime.test_packed_weights import _prefill, _step, assert_batched_hits_match


def _required_onednn() -> None:
    problem = onednn_problem()
    if problem is not None:
        pytest.skip(f"oneDNN products cannot run here: {problem}")


@pytest.mark.parametrize("rows", [1, 5, FEW_ROWS, FEW_ROWS + 1, 300])
@pytest.mark.parametrize("layout", ["input-major", "row-major"])
def test_onednn_linear_matches_float64(rows: int, layout: str) -> None:
    """Against a float64 product: as close as MKL's (float32 rounding, 1e-5 x sqrt(K)), on the
    compact forward's input-major weights and plain ones, with a bias and a 3-D input."""
    _required_onednn()
    torch.manual_seed(rows)
    n, k = 200, 576
    weight = torch.randn(k, n).t() if layout == "input-major" else torch.randn(n, k)
    bias, x = torch.randn(n), torch.randn(rows, 1, k)
    want = x.double() @ weight.double().t() + bias.double()
    got = onednn_linear(x, weight, bias)
    assert got.shape == (rows, 1, n) and got.dtype == torch.float32
    tol = 1e-5 * math.sqrt(k)
    assert (got.double() - want).abs().max().item() < tol
    assert (F.linear(x, weight, bias).double() - want).abs().max().item() < tol


@pytest.fixture
def setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.delenv(PRODUCTS_ENV, raising=False)
    yield monkeypatch


def test_choice_follows_the_setting(setting: pytest.MonkeyPatch) -> None:
    _required_onednn()
    weight = torch.randn(96, 64).t()
    setting.setenv(PRODUCTS_ENV, "mkl")
    assert choose_products(weight) == MKL_ONLY._replace(reason=f"{PRODUCTS_ENV}=mkl")
    setting.setenv(PRODUCTS_ENV, "ONEDNN")
    assert choose_products(weight)[:2] == ("onednn", "onednn")
    setting.setenv(PRODUCTS_ENV, "fast")  # not understood: not taken as on
    choice = choose_products(weight)
    assert choice[:2] == ("mkl", "mkl") and "'fast' not understood" in choice.reason
    for auto in ("auto", ""):
        setting.setenv(PRODUCTS_ENV, auto)
        choice = choose_products(weight)
        assert choice.few in ("mkl", "onednn") and choice.many in ("mkl", "onednn")
        assert choice.reason.startswith("measured on a 64x96 weight: 16 rows oneDNN")
    # not fp32 on the CPU: MKL (torch's own choice), with the reason
    choice = choose_products(weight.to(torch.bfloat16))
    assert choice[:2] == ("mkl", "mkl") and "torch.bfloat16" in choice.reason


def test_no_onednn_below_the_highest_float32_precision(setting: pytest.MonkeyPatch) -> None:
    """With ``torch.set_float32_matmul_precision("medium")`` oneDNN may round fp32 inputs to
    bf16: then it is never chosen, not even when asked for."""
    _required_onednn()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert "float32 matmul precision is 'bf16'" in str(onednn_problem())
        setting.setenv(PRODUCTS_ENV, "onednn")
        choice = choose_products(torch.randn(96, 64))
        assert choice[:2] == ("mkl", "mkl") and "'bf16'" in choice.reason
    finally:
        torch.set_float32_matmul_precision(before)


def test_mixed_precision_settings_do_not_fail_a_load(setting: pytest.MonkeyPatch) -> None:
    """torch's legacy getter raises once the per-backend settings disagree (another backend set
    to tf32): the choice still comes back, from oneDNN's own setting."""
    _required_onednn()
    cuda = torch.backends.cuda.matmul
    before = cuda.fp32_precision
    cuda.fp32_precision = "tf32"
    try:
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        assert onednn_problem() is None
        setting.setenv(PRODUCTS_ENV, "onednn")
        assert choose_products(torch.randn(96, 64))[:2] == ("onednn", "onednn")
    finally:
        cuda.fp32_precision = before


@pytest.mark.parametrize(
    ("few", "many", "rows", "label"),
    [
        ("mkl", "mkl", (1, 0), ""),
        ("onednn", "onednn", (1, 1 << 62), "oneDNN products"),
        ("onednn", "mkl", (1, FEW_ROWS), "oneDNN products for decode"),
        ("mkl", "onednn", (FEW_ROWS + 1, 1 << 62), "oneDNN products for prefill"),
    ],
)
def test_choice_rows_and_label(few: str, many: str, rows: tuple[int, int], label: str) -> None:
    choice = ProductChoice(few, many, "")  # type: ignore[arg-type]
    assert choice.onednn_rows() == rows and choice.describe() == label
    # with packed copies the few-row products read them: only prefill can be named
    prefill = "oneDNN products for prefill" if many == "onednn" else ""
    assert choice.describe(packed=True) == prefill


def _ops(fn: object) -> set[str]:
    """The names of the ops ``fn()`` dispatched (torch.profiler sees the C++ loop's calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()  # type: ignore[operator]
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_product_follows_the_choice(arch: str) -> None:
    """The C++ layer loop (a decode step) and the Python path (a prefill) run each product on
    the library chosen for its row count, and give the same logits as MKL within float32
    tolerance (Qwen2: QKV biases)."""
    _required_onednn()
    kernels = chosen_kernels()
    model = _model(arch, 4, 2, 16)
    mkl = CompactLlama(copy.deepcopy(model), native=kernels)
    dnn = ProductChoice("onednn", "onednn", "test")
    prefill_only = ProductChoice("mkl", "onednn", "test")
    both = CompactLlama(copy.deepcopy(model), native=kernels, products=dnn)
    split = CompactLlama(model, native=kernels, products=prefill_only)
    onednn, mkl_op = "mkldnn::_linear_pointwise", "aten::linear"
    big = FEW_ROWS + 6
    for run, rows in ((_step, 3), (_prefill, 5), (_prefill, big)):
        want = run(mkl, rows)
        assert mkl_op in _ops(lambda r=run, n=rows: r(mkl, n))
        ops = _ops(lambda r=run, n=rows: r(both, n))
        assert onednn in ops and mkl_op not in ops, (run, rows)
        torch.testing.assert_close(run(both, rows), want, atol=1e-4, rtol=1e-4)
        ops = _ops(lambda r=run, n=rows: r(split, n))
        many = rows > FEW_ROWS
        assert (onednn in ops) == many and (mkl_op in ops) == (not many), (run, rows)


@pytest.mark.parametrize("library", ["mkl", "onednn"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_on_either_library_matches_its_model(
    arch: str, library: str, tmp_path: Path, setting: pytest.MonkeyPatch
) -> None:
    """Requests decoded together, prefix-cache misses then hits, prompts of few and of many
    (over ``FEW_ROWS``) tokens: every step's logits are the model's own transformers forward
    within float32 tolerance, on either library; the start line names oneDNN."""
    if library == "onednn":
        _required_onednn()
    chosen_kernels()
    setting.setenv(PRODUCTS_ENV, library)
    path = save_tiny_model(arch, tmp_path)
    engine = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4)
    products = engine.runner.products
    assert products is not None and products[:2] == (library, library)
    assert _runs(engine).endswith(", oneDNN products)" if library == "onednn" else "attention)")
    assert_batched_hits_match(engine, (21, FEW_ROWS + 14, 9))
    engine.close()


def test_packed_start_line_names_only_prefill(tmp_path: Path, setting: pytest.MonkeyPatch) -> None:
    """With bfloat16 weights the few-row products read the packed copies, so oneDNN chosen for
    them is not claimed on the start line, only for prefill; with float32-packed every product
    reads the copies (the weights as loaded are freed), so no library is named."""
    _required_onednn()
    if not chosen_kernels().is_vectorized:
        pytest.skip("scalar kernels keep no packed copies (test_no_copies_where_nothing_...)")
    setting.setenv(PRODUCTS_ENV, "onednn")
    path = str(save_tiny_model("llama", tmp_path))
    for weights, tail in (("bfloat16", ", oneDNN products for prefill)"), ("float32-packed", ")")):
        engine = Engine.from_pretrained(path, weights=weights)
        assert engine.runner.compact is not None and engine.runner.compact.packed_products
        assert _runs(engine).endswith(
            f", {weights} weights, compact forward, native decode attention{tail}"
        )
        engine.close()


def test_no_choice_off_the_compact_forward(tmp_path: Path) -> None:
    """The transformers forward keeps torch's own products, and says nothing about them."""
    path = str(save_tiny_model("llama", tmp_path))
    engine = Engine.from_pretrained(path, forward="transformers")
    assert engine.runner.products is None and "oneDNN" not in _runs(engine)
    engine.close()


def test_measuring_takes_the_faster_library(setting: pytest.MonkeyPatch) -> None:
    """``auto`` keeps oneDNN only where it took under 90% of MKL's time, per class of rows."""
    _required_onednn()
    times = iter([(1.0, 0.5), (1.0, 0.95)])  # (MKL, oneDNN) seconds: 16 rows, then 512
    setting.setattr(fp32_products, "_best_of", lambda *_: next(times))
    setting.setattr(fp32_products, "_MEASURED", {})
    weight = torch.randn(96, 64)
    torch.manual_seed(7)
    assert choose_products(weight)[:2] == ("onednn", "mkl")
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), drawn)  # measuring left the caller's random stream alone
    # measured once per process and shape: a second load runs the same products
    assert choose_products(weight.clone())[:2] == ("onednn", "mkl")


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 17, ROWS_MAX, ROWS_MAX + 1])
@pytest.mark.parametrize(
    ("n", "k"), [(200, 576), (2048 + 40, 64), (2048 + 40, 576), (17, 130), (5000, 7)]
)
def test_linear_rows_matches_float64(isa: str, rows: int, n: int, k: int) -> None:
    """``linear_rows`` over an input-major weight against a float64 product, as close as MKL's:
    rows in and out of its 4-row groups (one and two rows) and its register tiles (from three:
    8 rows and the rest on AVX-512 and NEON, equal tiles of up to 6 rows on AVX2 and scalar, 7 as
    3 + 4 and 17 as 5 + 6 + 6), columns past a whole vector, a tile's strip, a 2,048-column tile
    and several panels (whose next turns it prefetches), K not a multiple of its 8-input passes
    and below 64 per thread (one partial sum), a bias and a 3-D input."""
    kernels = isa_kernels(isa)
    torch.manual_seed(rows * n + k)
    weight, bias, x = torch.randn(k, n).t(), torch.randn(n), torch.randn(rows, 1, k)
    want = x.double() @ weight.double().t() + bias.double()
    got = kernels.linear_rows(x, weight, bias)
    assert got.shape == (rows, 1, n) and got.dtype == torch.float32
    tol = 1e-5 * math.sqrt(k)
    assert (got.double() - want).abs().max().item() < tol
    no_bias = kernels.linear_rows(x, weight, None)
    assert (no_bias.double() - (want - bias.double())).abs().max().item() < tol


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("threads", [1, 3])
def test_linear_rows_on_other_thread_counts(isa: str, threads: int) -> None:
    """One thread (no partial sums) and three (a K range that does not split evenly), with
    columns past a 2,048-column tile."""
    kernels = isa_kernels(isa)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(threads)
        weight, x = torch.randn(577, 2088).t(), torch.randn(6, 577)
        got = kernels.linear_rows(x, weight, None)
    finally:
        torch.set_num_threads(before)
    want = x.double() @ weight.double().t()
    assert (got.double() - want).abs().max().item() < 1e-5 * math.sqrt(577)


def test_rows_timing_takes_a_row_major_weight(setting: pytest.MonkeyPatch) -> None:
    """The timing copies the weight input-major, whatever its own layout (a caller other than
    the engine may pass a row-major one); it never raises."""
    kernels = chosen_kernels()
    setting.setattr(fp32_products, "_MEASURED", {})
    choice = choose_products(torch.randn(96, 64), rows_kernel=kernels.linear_rows)
    assert "linear_rows" in choice.reason


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_linear_rows_refuses_other_layouts_and_types(isa: str) -> None:
    kernels = isa_kernels(isa)
    weight, x = torch.randn(64, 32).t(), torch.randn(2, 64)  # [32, 64] input-major
    assert kernels.linear_rows(x, weight, None).shape == (2, 32)
    for bad_x, bad_w, bias, words in (
        (x, torch.randn(32, 64), None, "input-major"),  # row-major [N, K]
        (x, torch.randn(64, 48).t()[:32], None, "input-major"),  # a slice: stride 48, not 32
        (x.double(), weight, None, "fp32"),
        (x, weight.double(), None, "fp32"),
        (torch.randn(2, 63), weight, None, "inputs"),
        (x, weight, torch.randn(31), "bias"),
    ):
        with pytest.raises(RuntimeError, match=words):
            kernels.linear_rows(bad_x, bad_w, bias)


def test_rows_choice_and_label(setting: pytest.MonkeyPatch) -> None:
    """``linear_rows`` is measured against the few-row library at 16 rows and kept for up to
    ``ROWS_MAX`` rows only under 90% of its time; else measured at 1 row and kept for one row
    only under 90% there; forcing a library (or no kernel) leaves it out; the label names it."""
    kernels = chosen_kernels()
    weight = torch.randn(96, 64).t()
    for rows_time, one_row_time, rows in ((0.5, None, ROWS_MAX), (0.95, 0.5, 1), (0.95, 0.95, 0)):
        # 16 rows, 512 rows, 16 rows of linear_rows, then 1 row (not measured after a win)
        times = iter([(1.0, 1.0), (1.0, 1.0), (1.0, rows_time), (1.0, one_row_time)])
        setting.setattr(fp32_products, "_best_of", lambda *_, t=times: next(t))
        setting.setattr(fp32_products, "_MEASURED", {})
        choice = choose_products(weight, rows_kernel=kernels.linear_rows)
        assert choice.rows == rows and "16 rows linear_rows" in choice.reason, choice
        assert ("1 row" in choice.reason) == (one_row_time is not None), choice
    assert MKL_ONLY._replace(rows=1).describe() == "linear_rows for 1 row"
    setting.setattr(fp32_products, "_MEASURED", {})
    setting.setattr(fp32_products, "_best_of", lambda *_: (1.0, 0.5))
    assert choose_products(weight).rows == 0  # no kernel: nothing to measure
    for forced in ("mkl", "onednn"):
        setting.setenv(PRODUCTS_ENV, forced)
        assert choose_products(weight, rows_kernel=kernels.linear_rows).rows == 0
    both = ProductChoice("onednn", "onednn", "", ROWS_MAX)
    assert both.describe() == f"oneDNN products, linear_rows up to {ROWS_MAX} rows"
    assert MKL_ONLY._replace(rows=ROWS_MAX).describe() == f"linear_rows up to {ROWS_MAX} rows"
    assert both.describe(packed=True) == "oneDNN products for prefill"


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows_max", [1, ROWS_MAX])
def test_few_row_products_follow_the_rows_choice(isa: str, arch: str, rows_max: int) -> None:
    """With ``rows`` chosen, a decode step (the C++ loop) and a prefill (the Python path) of at
    most ``rows`` rows dispatch no library product at all, LM head included; one more row
    goes back to the library; the logits equal MKL's within float32 tolerance."""
    kernels = isa_kernels(isa)
    model = _model(arch, 4, 2, 16)
    mkl = CompactLlama(copy.deepcopy(model), native=kernels)
    rows = CompactLlama(model, native=kernels, products=MKL_ONLY._replace(rows=rows_max))
    for run, n in ((_step, 1), (_step, rows_max), (_prefill, 3), (_step, rows_max + 1)):
        ops = _ops(lambda r=run, k=n: r(rows, k))
        assert ("aten::linear" in ops) == (n > rows_max), (run, n)
        torch.testing.assert_close(run(rows, n), run(mkl, n), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_with_linear_rows_matches_its_model(
    arch: str, tmp_path: Path, setting: pytest.MonkeyPatch
) -> None:
    """An engine whose measurement kept ``linear_rows`` (fake timings): batched decode steps,
    prefix-cache misses then hits, prompts of few and many tokens all give the model's own
    transformers logits within float32 tolerance; the start line names it. (The scalar kernels'
    ``linear_rows`` is never measured: it is slower than either library.)"""
    vectorized = chosen_kernels().is_vectorized
    setting.setattr(fp32_products, "_MEASURED", {})
    setting.setattr(fp32_products, "_best_of", lambda *_: (1.0, 0.5))
    path = save_tiny_model(arch, tmp_path)
    engine = Engine.from_pretrained(str(path), kv_cache_bytes=1 << 22, block_size=4)
    products = engine.runner.products
    assert products is not None and products.rows == (ROWS_MAX if vectorized else 0)
    assert _runs(engine).endswith(f"linear_rows up to {ROWS_MAX} rows)") == vectorized
    assert_batched_hits_match(engine, (21, FEW_ROWS + 14, 9))
    engine.close()


def test_prefix_attention_is_measured_against_torch_flash(setting: pytest.MonkeyPatch) -> None:
    """The cascade's shared prefix goes to the native ``prefix_attention`` only where it took
    under 90% of torch's flash kernel's time (the winner depends on the CPU), measured once per
    (KV heads, head dim, threads, ISA); a head dim the kernel does not take is never timed."""
    times = iter([(0.5, 1.0), (0.95, 1.0)])  # (native, flash) seconds
    setting.setattr(fp32_products, "_best_of", lambda *_: next(times))
    setting.setattr(fp32_products, "_PREFIX_MEASURED", {})

    def never(*_: object) -> None:
        raise AssertionError("not called: _best_of is faked")

    assert choose_prefix_attention(never, never, 3, 64, "avx2")[0]
    assert choose_prefix_attention(never, never, 3, 64, "avx2")[0]  # measured once
    use, why = choose_prefix_attention(never, never, 2, 64, "avx2")
    assert not use and why.startswith("measured at 2 x 512 queries over 1024 keys")
    assert choose_prefix_attention(never, never, 3, 24, "avx2") == (
        False, "head dim 24 is not a multiple of 16 up to 128")  # fmt: skip


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_prefix_attention_choice_on_real_kernels(isa: str, setting: pytest.MonkeyPatch) -> None:
    """Timed for real, either answer can win here; the compact forward records it and why."""
    from runtime.model.compact_llama import CompactLlama

    kernels = isa_kernels(isa)
    setting.setattr(fp32_products, "_PREFIX_MEASURED", {})
    compact = CompactLlama(_model("llama", 4, 2, 16), native=kernels)
    assert isinstance(compact.native_prefix_attention, bool)
    assert compact.prefix_attention_reason.startswith("measured at 2 x 512 queries")
