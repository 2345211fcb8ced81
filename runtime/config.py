"""EngineConfig: every option of an engine in one frozen record, validated in one place.

Plain data without torch: ``agentcache serve`` derives its flags from these fields (help from
their docstrings, defaults from the dataclass: ``runtime.serve.flags``) and checks them before the
model loads. Values discovered while loading (the KV shape, the forward path taken) live on the
engine, never here. It knows the cache's policy names, never the model, requests or HTTP.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, TypeAlias, get_args

from runtime.cache.eviction import EVICTION_POLICIES, EvictionPolicy
from runtime.cache.records import DISK_POLICIES, DiskPolicy
from runtime.scheduler.config import SchedulerConfig

__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_KV_DISK_BYTES",
    "DEFAULT_KV_DISK_FLUSH_S",
    "DISK_POLICIES",
    "DiskPolicy",
    "Dtype",
    "EngineConfig",
    "ForwardPath",
    "KVDtype",
    "WeightsDtype",
    "field_docs",
    "validate",
]

Dtype: TypeAlias = Literal["float32", "bfloat16", "float16"]
ForwardPath: TypeAlias = Literal["auto", "compact", "transformers"]
"""``compact``: ``runtime.model.compact_llama`` (Llama family); ``transformers``: the model's own
forward (every architecture, the reference); ``auto``: compact where supported."""

WeightsDtype: TypeAlias = Literal["float32", "bfloat16", "float32-packed", "q8_0", "q4_1"]
"""How a float32 model holds its weights: ``float32`` as loaded (the reference);
``bfloat16``: every linear layer's weight (the LM head and a tied embedding included) rounded to
bfloat16, nearest even, while activations, the KV cache and all arithmetic stay float32 (see
``round_weights_bf16``); ``float32-packed``: the same values moved into packed fp32 copies
(blocks of 32 output columns) that every product of the compact forward reads, the weights as
loaded freed (vectorized native kernels; the same bytes; the same answers within float32
rounding; the model's own transformers forward then no longer runs); ``q8_0`` /
``q4_1``: every linear weight rounded to GGUF's Q8_0 / Q4_1 blocks (the LM head and a tied
embedding to ``QUANT_HEAD_FORMAT``'s, Q8_0; see ``round_weights_quantized``), and on the compact
forward with vectorized native kernels the blocks themselves kept for decode-step products
(``linear_quantized``: 8.5 / 5 bits a weight). A quantized model is another model: its answers
are those of the rounded weights, labelled so (``/v1/models``, usage)."""
KVDtype: TypeAlias = Literal["auto", "float32", "float16"]
"""The KV cache's element type, apart from the compute dtype (float32 models only; a 16-bit
model's KV is of its dtype): ``float32`` as computed; ``float16``: keys and values rounded to
IEEE fp16 (nearest even) when they are written, and every attention, prefill's and decode's,
reads those rounded values (computing in fp32); half the KV bytes (memory, the prefix cache's
budget, and what each decode step reads). NOTE: opt-in, because fp16 rounding magnifies the
last-bit differences between a hit's and a miss's prefill (other matrix shapes): on SmolLM2-135M
(q8_0) their logits differed by 6.7e-3 against 4.1e-5 with fp32 K/V, and `bench qa` answered 1
of 134 questions differently with the cache on (a near-tie flip), where fp32 K/V match token for
token. ``auto``: the model's dtype."""
DEFAULT_KV_CACHE_BYTES = 1 << 30
"""Prefix cache budget when none is given: 1 GiB of KV blocks."""
DEFAULT_CHUNK_CACHE_BYTES = 256 << 20
"""Chunk store budget when none is given: 256 MiB (pages are touched only as chunks arrive)."""
DEFAULT_KV_DISK_BYTES = 8 << 30
"""Disk tier budget when ``kv_disk_dir`` is given without ``kv_disk_bytes``: 8 GiB of files."""
DEFAULT_KV_DISK_FLUSH_S = 5.0
"""Most seconds ``close`` spends writing queued disk-tier blocks (a graceful shutdown)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What an ``Engine`` loads and how it caches and schedules (``Engine.from_pretrained``).

    Raises:
        ValueError: on construction, for a value out of range or options that do not go
            together (``validate`` says which).
    """

    dtype: Dtype = "float32"
    """Weights and KV cache dtype; float32 is the reference. bfloat16 halves their memory and,
    on a CPU with AVX-512 BF16, cut a 256-token prefill ~2x but slowed decode ~1.2-1.5x (W1, 2
    threads); answers match float32 only within 16-bit rounding."""
    weights: WeightsDtype = "float32"
    """float32 models only: bfloat16 rounds the linear weights to bfloat16 while activations, KV
    cache and arithmetic stay float32; decode steps then read half the weight bytes (compact
    forward, native kernels). float32-packed moves the linear weights into packed copies that every
    product streams faster (batched decode steps most; no extra memory: the weights as loaded
    are freed). q8_0 / q4_1: a quantized
    model (labelled so): linear weights rounded to GGUF's Q8_0 / Q4_1 blocks (a .gguf file's
    own blocks when it holds them) that decode steps read directly, 8.5 / 5 bits a weight."""
    kv_dtype: KVDtype = "auto"
    """KV cache element type: float16 rounds keys and values to fp16 when written (half the KV
    memory and the bytes a decode step reads, as llama.cpp's default f16 KV; every attention
    reads the rounded values, and a cache hit equals a miss only within fp16 rounding, so a
    near-tie token may flip; compact forward only); float32 keeps them as computed; auto is the
    model's dtype (the only choice for a 16-bit dtype)."""
    forward: ForwardPath = "auto"
    """Which forward runs the model: auto (the compact Llama-family forward where it applies,
    else the model's own), compact, or transformers (the reference)."""
    device: str = "cpu"
    """Torch device string the model loads on."""
    revision: str | None = None
    """Hub revision to load (none: the default branch, or a local folder as it is)."""
    block_size: int = 16
    """Tokens per cached block: prefixes are reused in whole blocks."""
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    """Prefix cache budget, bytes of KV blocks in memory."""
    prefix_cache: bool = field(default=True, metadata={"flag": "--no-prefix-cache"})
    """Reuse prefix-cache KV; off is force-miss (the same code path, never a hit). Requests that
    send chunk_reuse still reuse their documents from the chunk store."""
    eviction: EvictionPolicy = "adaptive"
    """Which unpinned cached blocks of the prefix cache go first when its budget is full:
    adaptive (ranks as lru until slru's metadata-only virtual cache has shown it hits more, then
    as whichever of the two leads), adaptive-shared (the previous default: follows whichever of
    shared and lru wins, starting as shared), slru (segmented LRU: prefixes several cached
    sequences extend go after every other block), shared (sharing-aware GreedyDual: prefixes
    many requests extended stay longer) or lru (least recently used leaf first). The chunk
    store, a flat store without the virtual caches, ranks by shared under the others
    (``chunk_eviction``)."""
    chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES
    """Chunk store budget for requests with chunk_reuse, bytes."""
    kv_disk_dir: str | None = None
    """Disk tier below the KV pool: cached blocks are written here (see kv_disk_policy) and
    survive restarts; files are named by model, revision, dtype, tenant salt and a weights
    fingerprint, so another model never reuses them (none: no disk tier)."""
    kv_disk_bytes: int | None = None
    """Byte budget of kv_disk_dir, block files and headers included (none: 8 GiB)."""
    kv_disk_policy: DiskPolicy | None = None
    """When blocks reach kv_disk_dir: write-through queues each new cached block for disk in the
    background (deduplicated; a full queue drops the write, never the request), so a clean
    restart finds the cache warm; evict writes only blocks evicted from memory (none:
    write-through)."""
    kv_disk_flush_s: float | None = field(
        default=None, metadata={"flag": "--kv-disk-flush-seconds"}
    )
    """On a graceful shutdown (SIGTERM, Ctrl-C), most seconds spent writing the blocks still
    queued for kv_disk_dir; the rest are dropped (none: 5 s)."""
    debug_integrity: bool = False
    """Check the caches' integrity whenever the scheduler goes idle (slow; for tests)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Batching, ordering and admission limits."""

    def __post_init__(self) -> None:
        validate({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def chunk_eviction(self) -> EvictionPolicy:
        """The chunk store's policy: ``eviction`` when it is ``"lru"``, else ``"shared"``."""
        return "lru" if self.eviction == "lru" else "shared"

    @property
    def disk_bytes(self) -> int:
        """The disk tier's byte budget (``kv_disk_bytes`` or its default)."""
        return DEFAULT_KV_DISK_BYTES if self.kv_disk_bytes is None else self.kv_disk_bytes

    @property
    def disk_policy(self) -> DiskPolicy:
        """The disk tier's policy (``kv_disk_policy`` or ``"write-through"``)."""
        return self.kv_disk_policy or "write-through"

    @property
    def disk_flush_s(self) -> float:
        """``close``'s deadline for queued disk writes (``kv_disk_flush_s`` or its default)."""
        return DEFAULT_KV_DISK_FLUSH_S if self.kv_disk_flush_s is None else self.kv_disk_flush_s

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (field names; ``scheduler=None`` keeps the default limits).

        Raises:
            TypeError: a name that is not a field.
            ValueError: as the constructor.
        """
        if changes.get("scheduler", 0) is None:
            changes["scheduler"] = SchedulerConfig()
        if isinstance(changes.get("kv_disk_dir"), os.PathLike):
            changes["kv_disk_dir"] = os.fspath(changes["kv_disk_dir"])
        return dataclasses.replace(self, **changes)


def _choice(name: str, value: object, valid: tuple[str, ...], spell: Callable[[str], str]) -> None:
    if value not in valid:
        raise ValueError(f"{spell(name)} must be one of {list(valid)}, got {value!r}")


def validate(values: Mapping[str, Any], spell: Callable[[str], str] = str) -> None:
    """Check ``EngineConfig`` values, the ones given or all of them (the one validator).

    Args:
        values: field name -> value; a missing field counts as its default.
        spell: how a message names a field (``agentcache serve`` passes its flag's spelling).

    Raises:
        ValueError: the first problem, naming the field(s) as ``spell`` writes them.
    """
    get = values.get
    _choice("dtype", get("dtype", "float32"), get_args(Dtype), spell)
    _choice("forward", get("forward", "auto"), get_args(ForwardPath), spell)
    _choice("kv_dtype", get("kv_dtype", "auto"), get_args(KVDtype), spell)
    _choice("eviction", get("eviction", "adaptive"), EVICTION_POLICIES, spell)
    weights, dtype = get("weights", "float32"), get("dtype", "float32")
    if weights not in get_args(WeightsDtype):
        raise ValueError(
            f"{spell('weights')} must be one of {list(get_args(WeightsDtype))}, got {weights!r}"
        )
    if weights != "float32" and dtype != "float32":
        raise ValueError(
            f"{spell('weights')} {weights} needs {spell('dtype')} float32, not {dtype}"
        )
    kv_dtype = get("kv_dtype", "auto")
    if kv_dtype != "auto" and dtype != "float32":
        raise ValueError(
            f"{spell('kv_dtype')} {kv_dtype} needs {spell('dtype')} float32, not {dtype}"
        )
    if get("block_size", 16) < 1:
        raise ValueError(f"{spell('block_size')} must be >= 1, got {get('block_size')!r}")
    for name in ("kv_cache_bytes", "chunk_cache_bytes", "kv_disk_bytes", "kv_disk_flush_s"):
        value = get(name)
        if value is not None and not value >= 0:
            raise ValueError(f"{spell(name)} must be >= 0, got {value!r}")
    if get("kv_disk_policy") is not None:
        _choice("kv_disk_policy", get("kv_disk_policy"), DISK_POLICIES, spell)
    for name in ("kv_disk_bytes", "kv_disk_policy", "kv_disk_flush_s"):
        if get(name) is not None and get("kv_disk_dir") is None:
            raise ValueError(f"{spell(name)} needs {spell('kv_disk_dir')}")
    if not isinstance(get("scheduler", SchedulerConfig()), SchedulerConfig):
        raise ValueError(f"{spell('scheduler')} must be a SchedulerConfig")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring of dataclass ``cls``, one line (from its source).

    Raises:
        OSError: the class's source is not available.
    """
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[attr-defined]
    return docs
