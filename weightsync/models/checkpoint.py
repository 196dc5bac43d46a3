"""HF checkpoints of the registry models: config.json, synthetic weights, safetensors I/O.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json`` (the HF layout). Its
tensors are the global tensors of :func:`weightsync.models.hf.global_tensors`: HF names,
shapes and dtypes (fp8 models: bf16 weights plus float32 ``weight_scale_inv``; a real fp8
checkpoint stores the weights as float8_e4m3fn, which readers accept too).

Synthetic weights are a deterministic function of ``(spec, seed, name)``: every tensor is
generated on its own, so a rank can build exactly the tensors it needs. Their scale keeps a
deep stack numerically tame (linear weights ~ N(0, 1/fan_in), norms ~ 1). Block-quantized
(fp8) weights are made *fp8-exact*: each block is ``q * 2^k`` with one element at
``+-448 * 2^k``, so quantizing them (:func:`weightsync.quant.fp8.quantize_block_fp8`) loses
nothing and a dequantized engine weight equals the bf16 checkpoint weight bit for bit.

Typical usage::

    spec = get_model("Qwen3-30B-A3B", "tiny")
    write_hf_checkpoint(path, synthetic_hf_tensors(spec, seed=0), hf_config_dict(spec))
    with HFCheckpoint(path) as ckpt:
        w = ckpt.get_slice("model.embed_tokens.weight", ((0, 10), (0, 64)))
"""

from __future__ import annotations

import errno
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from weightsync.models.hf import GlobalTensor, global_tensors
from weightsync.models.spec import Family, ModelSpec

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "BOOL": "bool",
}
"""safetensors dtype tag -> torch dtype name."""


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` of ``spec``, in transformers 4.x spelling, with every key its family's
    HF/sglang model class reads (:func:`weightsync.models.config.spec_from_hf_config` reads it
    back into ``spec``).

    Args:
        spec: the model.

    Returns:
        A JSON-serialisable dict.
    """
    cfg: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.hf_model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": _rope_scaling_dict(spec),
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": spec.dtype,
        "attention_bias": spec.attention_bias,
    }
    if not spec.is_mla:
        cfg["head_dim"] = spec.head_dim
    if spec.family is Family.GLM4_MOE:
        cfg["partial_rotary_factor"] = spec.partial_rotary_factor
        cfg["use_qk_norm"] = spec.qk_norm
    if spec.is_moe:
        cfg.update(_moe_config(spec))
    if spec.is_mla:
        cfg.update(
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
        )
        if not spec.has_indexer:
            cfg["rope_interleave"] = spec.rope_interleave
    if spec.has_indexer:
        cfg.update(index_n_heads=spec.index_n_heads, index_head_dim=spec.index_head_dim, index_topk=spec.index_topk,
                   indexer_rope_interleave=spec.indexer_rope_interleave)
    if spec.fp8_block is not None:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(spec.fp8_block),
        }
    return cfg


def _rope_scaling_dict(spec: ModelSpec) -> dict[str, Any] | None:
    r = spec.rope_scaling
    if r is None:
        return None
    out: dict[str, Any] = {"type": "yarn", "factor": r.factor,
                           "original_max_position_embeddings": r.original_max_position_embeddings,
                           "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(r, key) is not None:
            out[key] = getattr(r, key)
    if not r.truncate:
        out["truncate"] = False
    return out


def _moe_config(spec: ModelSpec) -> dict[str, Any]:
    """MoE keys: Qwen3-MoE names them ``num_experts``; GLM/DeepSeek ``n_routed_experts``."""
    common = {
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
    }
    types = [("sparse" if spec.is_moe_layer(i) else "dense") for i in range(spec.num_layers)]
    if spec.family is Family.QWEN3_MOE:
        return {
            **common,
            "num_experts": spec.num_experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, t in enumerate(types) if t == "dense"],
        }
    out = {
        **common,
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": spec.num_shared_experts,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "scoring_func": spec.router_score_function,
        "topk_method": "noaux_tc" if spec.router_expert_bias else "group_limited_greedy" if spec.n_group > 1
        else "greedy",
    }
    if spec.router_fp32:
        out["router_fp32"] = True
    if spec.mlp_layer_types is None:
        out.update(first_k_dense_replace=spec.first_k_dense_replace, moe_layer_freq=spec.moe_layer_freq)
    else:
        out["mlp_layer_types"] = types
    return out


# --------------------------------------------------------------------------- synthetic weights


def _tensor_seed(seed: int, name: str) -> int:
    """A stable per-tensor seed (Python's ``hash`` is salted per process, crc32 is not)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _init_std(gt: GlobalTensor) -> tuple[float, float]:
    """(mean, std) of a tensor's synthetic values, chosen by its role."""
    name = gt.name
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.1
    if name.endswith("e_score_correction_bias"):
        return 0.0, 0.05
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    fan_in = gt.shape[-1] if len(gt.shape) >= 2 else 1
    return 0.0, 1.0 / math.sqrt(fan_in)


def synthetic_hf_tensor(
    spec: ModelSpec, name: str, seed: int = 0, device: str = "cpu", table: dict[str, GlobalTensor] | None = None
) -> Any:
    """One global tensor of the synthetic checkpoint of ``spec`` (see the module docstring).

    Args:
        spec: the model.
        name: a name of :func:`global_tensors` (fp8 ``weight_scale_inv`` names included).
        seed: checkpoint seed.
        device: where to generate (values depend on the device's generator).
        table: ``global_tensors(spec)``, when the caller has it (building it per call is slow at
            full scale).

    Returns:
        A torch tensor of the global shape and dtype.

    Raises:
        ValueError: ``name`` is not a global tensor of ``spec``.
    """
    table = table if table is not None else global_tensors(spec)
    gt = table.get(name)
    if gt is None:
        raise ValueError(f"{spec.name}: {name!r} is not a global tensor of the model")
    if gt.quant_of is not None:
        _, scale = _fp8_exact(table[gt.quant_of], seed, device)
        return scale
    if gt.block is not None:
        weight, _ = _fp8_exact(gt, seed, device)
        return weight
    return _normal(gt, seed, device)


def _normal(gt: GlobalTensor, seed: int, device: str) -> Any:
    import torch

    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, gt.name))
    mean, std = _init_std(gt)
    x = torch.randn(gt.shape, generator=gen, device=device, dtype=torch.float32) * std + mean
    return x.to(getattr(torch, gt.dtype))


def _fp8_exact(gt: GlobalTensor, seed: int, device: str) -> tuple[Any, Any]:
    """A block-quantizable weight with power-of-two block scales, and its float32 scale_inv."""
    import torch

    from weightsync.quant.fp8 import FP8_MAX, quantize_block_fp8

    assert gt.block is not None
    assert len(gt.shape) == 2
    b0, b1 = gt.block
    w = _normal(gt, seed, device).float()
    rows, cols = w.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    amax = torch.nn.functional.pad(w.abs(), (0, nc * b1 - cols, 0, nr * b0 - rows))
    amax = amax.reshape(nr, b0, nc, b1).amax(dim=(1, 3)).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    grid = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
    q = (w / grid).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # Pin each block's first element to +-448: the block's amax is then exactly 448 * scale,
    # so re-quantizing recovers the same power-of-two scale and the same fp8 values.
    q[::b0, ::b1] = torch.where(q[::b0, ::b1] < 0, -FP8_MAX, FP8_MAX)
    weight = (q * grid).to(getattr(torch, gt.dtype))
    requant, scale_inv = quantize_block_fp8(weight, gt.block)
    assert torch.equal(scale_inv, scale), "fp8-exact synthetic weight lost its power-of-two scale"
    assert torch.equal(requant.float() * grid, weight.float()), "fp8-exact synthetic weight is not exact"
    return weight, scale_inv


def synthetic_hf_tensors(spec: ModelSpec, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Every global tensor of ``spec``'s synthetic checkpoint (small scales only: all in memory).

    Args:
        spec: the model.
        seed: checkpoint seed.
        device: where to generate.

    Returns:
        name -> tensor, in :func:`global_tensors` order.
    """
    table = global_tensors(spec)
    out: dict[str, Any] = {}
    for name, gt in table.items():
        if gt.quant_of is not None:
            continue  # produced together with its weight
        if gt.block is not None:
            out[name], out[name + "_scale_inv"] = _fp8_exact(gt, seed, device)
        else:
            out[name] = _normal(gt, seed, device)
    return {name: out[name] for name in table}


# --------------------------------------------------------------------------- file I/O


def write_hf_checkpoint(
    path: str | Path, tensors: dict[str, Any], config: dict[str, Any], max_shard_bytes: int | None = None
) -> Path:
    """Write an HF checkpoint directory (creates it; overwrites files of the same names).

    Args:
        path: target directory.
        tensors: name -> torch tensor (made contiguous; CPU copies are written).
        config: the ``config.json`` content (:func:`hf_config_dict`).
        max_shard_bytes: split into ``model-0000K-of-0000N.safetensors`` shards of at most about
            this many bytes, with ``model.safetensors.index.json``; None writes one file.

    Returns:
        The directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in cpu.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if max_shard_bytes is None:
        _save_file(cpu, out / SINGLE_FILE)
        return out
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in cpu.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def _save_file(tensors: dict[str, Any], path: Path) -> None:
    """``safetensors.torch.save_file``, its I/O errors as :class:`OSError` (a full disk says so
    and names the file, as every other write does).

    Raises:
        OSError: the file could not be written.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        full = "No space left" in str(exc)
        raise OSError(errno.ENOSPC if full else errno.EIO, "No space left on device" if full else str(exc),
                      str(path)) from None


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint directory: metadata first, slices on demand.

    Typical usage::

        with HFCheckpoint(path) as ckpt:
            for name in ckpt.names():
                shape, dtype = ckpt.meta(name)
    """

    def __init__(self, path: str | Path) -> None:
        """Open ``path``.

        Raises:
            ValueError: no safetensors file, an index naming a missing file, or a file that is not
                safetensors (the message names the file).
        """
        from safetensors import safe_open

        self.path = Path(path)
        if (self.path / INDEX_FILE).is_file():
            weight_map = json.loads((self.path / INDEX_FILE).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path}: no *.safetensors file (expected {SINGLE_FILE} or {INDEX_FILE})")
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise ValueError(f"{self.path}: the index names missing files {missing}")
        from safetensors import SafetensorError

        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(str(self.path / f), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"{self.path / f}: not a readable safetensors file ({exc})") from None
        self._where: dict[str, str] = {}
        for f, h in self._handles.items():
            for name in h.keys():  # noqa: SIM118 -- safe_open handles have keys(), not __iter__
                self._where[name] = f

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Drop the file handles."""
        self._handles.clear()

    def config(self) -> dict[str, Any]:
        """The parsed ``config.json`` ({} when absent)."""
        p = self.path / CONFIG_FILE
        return json.loads(p.read_text()) if p.is_file() else {}

    def fp8_block(self) -> tuple[int, int] | None:
        """The block its float8 weights are quantized in (``quantization_config.weight_block_size``;
        None when the config declares no fp8 quantization).

        Raises:
            ValueError: a quantization the readers cannot dequantize.
        """
        from weightsync.models.config import checkpoint_fp8_block

        return checkpoint_fp8_block(self.config().get("quantization_config"), str(self.path / CONFIG_FILE))

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, torch dtype name)`` of tensor ``name`` without reading its data."""
        sl = self._handles[self._where[name]].get_slice(name)
        tag = sl.get_dtype()
        return tuple(sl.get_shape()), _ST_DTYPES.get(tag, tag.lower())

    def get(self, name: str) -> Any:
        """The whole tensor ``name`` (CPU)."""
        return self._handles[self._where[name]].get_tensor(name)

    def get_slice(self, name: str, box: tuple[tuple[int, int], ...]) -> Any:
        """The region ``box`` (per-dim ``(start, stop)``) of tensor ``name``, read lazily (CPU)."""
        sl = self._handles[self._where[name]].get_slice(name)
        return sl[tuple(slice(a, b) for a, b in box)]

    def items(self) -> Iterator[tuple[str, Any]]:
        for name in self._where:
            yield name, self.get(name)


def read_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a whole checkpoint into memory (small checkpoints; use :class:`HFCheckpoint` otherwise).

    Args:
        path: checkpoint directory.

    Returns:
        ``(tensors, config)``.
    """
    with HFCheckpoint(path) as ckpt:
        return dict(ckpt.items()), ckpt.config()
