"""HF checkpoints as the trainer's source: check one against a model, read its tensors in the
trainer's dtype, write a synthetic one.

:func:`check_hf_checkpoint` refuses a checkpoint that is not the model: ``config.json`` numbers
that shape the tensors (hidden size, heads, experts, MLA ranks, ...) must equal the spec's, and
every tensor the trainer holds must be present with its global shape. A model loaded at
``layers=N`` from a full checkpoint reads the first N layers (the config may say more layers,
and the extra layers' tensors are ignored).

fp8 checkpoints (DeepSeek-V3 style): a float8_e4m3fn weight with its ``weight_scale_inv`` is
dequantized to the trainer's dtype on read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightsync.layout.box import Box
from weightsync.models.checkpoint import HFCheckpoint, hf_config_dict, synthetic_hf_tensor, write_hf_checkpoint
from weightsync.models.hf import global_tensors
from weightsync.models.spec import ModelSpec
from weightsync.sources.torch_dist import ReadGlobal, torch_dtype

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHAPE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "tie_word_embeddings", "attention_bias", "use_qk_norm", "num_experts", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
)
"""config.json keys that decide which tensors exist and their shapes."""
_MAX_LISTED = 20
SHARD_BYTES = 2 << 30
"""Largest safetensors shard of a synthetic checkpoint."""


def _listed(kind: str, items: list[str]) -> str:
    more = f" ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{len(items)} {kind}: {', '.join(items[:_MAX_LISTED])}{more}"


def config_mismatches(spec: ModelSpec, config: dict[str, Any]) -> list[str]:
    """The shape-deciding ``config.json`` entries that differ from ``spec`` (keys absent from
    ``config`` are not checked: the tensor check covers them).

    Args:
        spec: the model at its scale.
        config: the checkpoint's parsed config.json.

    Returns:
        One ``"key: checkpoint X, model Y"`` line per difference.
    """
    want = hf_config_dict(spec)
    out = []
    arch = config.get("architectures")
    if arch and arch[0] != spec.hf_architecture:
        out.append(f"architectures: checkpoint {arch[0]!r}, model {spec.hf_architecture!r}")
    layers = config.get("num_hidden_layers")
    if layers is not None and (layers < spec.num_layers if spec.scale.startswith("layers=") else
                               layers != spec.num_layers):
        out.append(f"num_hidden_layers: checkpoint {layers}, model {spec.num_layers} (scale {spec.scale})")
    for key in _SHAPE_KEYS:
        if key in config and key in want and config[key] != want[key]:
            out.append(f"{key}: checkpoint {config[key]!r}, model {want[key]!r}")
    return out


def check_hf_checkpoint(path: str | Path, spec: ModelSpec) -> None:
    """Refuse an HF checkpoint directory that does not hold ``spec``'s trainer tensors.

    Args:
        path: the directory (``config.json`` + safetensors).
        spec: the model at its scale.

    Raises:
        ValueError: naming every config mismatch, missing tensor, mis-shaped tensor and
            unexpected tensor (the message starts with the directory and the model).
    """
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"HF checkpoint {p} is not a directory")
    with HFCheckpoint(p) as ckpt:
        problems = []
        cfg = ckpt.config()
        if not cfg:
            problems.append("no config.json")
        mismatched = config_mismatches(spec, cfg)
        if mismatched:
            problems.append(_listed("config mismatches", mismatched))
        table = global_tensors(spec)
        present = set(ckpt.names())
        needed = [n for n, g in table.items() if g.quant_of is None]
        missing = [n for n in needed if n not in present]
        misshaped = [f"{n} {list(ckpt.meta(n)[0])} (expected {list(table[n].shape)})"
                     for n in needed if n in present and ckpt.meta(n)[0] != table[n].shape]
        unscaled = [n for n in needed if n in present and ckpt.meta(n)[1] == "float8_e4m3fn"
                    and n + "_scale_inv" not in present]
        unexpected = [n for n in sorted(present - set(table))
                      if not ((m := _LAYER.match(n)) and int(m.group(1)) >= spec.num_layers)]
        for kind, items in (("missing tensors", missing), ("mis-shaped tensors", misshaped),
                            ("fp8 weights without weight_scale_inv", unscaled), ("unexpected tensors", unexpected)):
            if items:
                problems.append(_listed(kind, items))
    if problems:
        raise ValueError(f"HF checkpoint {p} does not match {spec.name} (scale {spec.scale}): " + "; ".join(problems))


def global_reader(ckpt: HFCheckpoint, spec: ModelSpec) -> ReadGlobal:
    """``read(name, box)`` over an open checkpoint, in the trainer's dtype (fp8 dequantized).

    Slices are read lazily; an fp8 weight is dequantized whole once and kept until another
    fp8 weight is read.
    """
    table = global_tensors(spec)
    cache: dict[str, torch.Tensor] = {}

    def read(name: str, box: Box) -> torch.Tensor:
        dtype = torch_dtype(table[name].dtype)
        if ckpt.meta(name)[1] != "float8_e4m3fn":
            return ckpt.get_slice(name, box).to(dtype)
        if name not in cache:
            from weightsync.quant.fp8 import dequantize_block_fp8

            q, scale = ckpt.get(name), ckpt.get(name + "_scale_inv")
            block = spec.fp8_block or (-(-q.shape[0] // scale.shape[0]), -(-q.shape[1] // scale.shape[1]))
            cache.clear()
            cache[name] = dequantize_block_fp8(q, scale, block, dtype)
        return cache[name][tuple(slice(a, b) for a, b in box)]

    return read


def synthetic_bytes(spec: ModelSpec) -> int:
    """Bytes of the synthetic HF checkpoint of ``spec`` (to refuse absurd sizes early)."""
    return sum(g.nbytes for g in global_tensors(spec).values())


def write_synthetic_hf(path: str | Path, spec: ModelSpec, seed: int, *,
                       progress: Callable[[int], None] | None = None) -> Path:
    """Write a seeded random-init HF checkpoint of ``spec`` (synthetic weights, real layout).

    The whole checkpoint is built in memory (see :func:`synthetic_bytes`), then written in
    safetensors shards of at most 2 GiB with an index (one file when it fits).

    Args:
        path: target directory (created).
        spec: the model at its scale.
        seed: checkpoint seed.
        progress: called with each tensor's byte count as it is generated.

    Returns:
        The directory.
    """
    table = global_tensors(spec)
    tensors: dict[str, torch.Tensor] = {}
    for name in table:
        tensors[name] = synthetic_hf_tensor(spec, name, seed, table=table)
        if progress is not None:
            progress(tensors[name].numel() * tensors[name].element_size())
    limit = SHARD_BYTES if synthetic_bytes(spec) > SHARD_BYTES else None
    return write_hf_checkpoint(path, tensors, hf_config_dict(spec), max_shard_bytes=limit)
