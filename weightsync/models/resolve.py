"""The spec a command runs: the registry's shapes, or a checkpoint's ``config.json`` served as a
registry model.

The registry model (``MODEL`` on the command line) names the run profile: parallel sizes, sglang
and Megatron flags, and whether the engine stores linear weights in block fp8. A checkpoint
brings the architecture and every shape (:func:`weightsync.models.config.spec_from_hf_config`);
it must be of the model's family (a GLM-5 profile takes ``GlmMoeDsaForCausalLM`` and the
``DeepseekV32ForCausalLM`` its reference system patches the config to; every other profile the
architecture of its registry entry). Without a checkpoint the registry's shapes at ``scale`` are
the ones weights are synthesized for.

Scales with a checkpoint: ``layers=N`` serves its first N layers; ``full`` and ``tiny`` serve it
as it is (the scale then only labels the run). :func:`describe_model` is how every command names
what it serves or trains: a checkpoint by its directory and its own dimensions, registry shapes by
model and scale.

A block-fp8 checkpoint for an fp8 profile keeps its own block (an engine re-blocks it only where a
shard would cut it: :func:`weightsync.layout.sglang_fp8.serving_fp8_block`).

Typical usage::

    spec = model_spec("Kimi-K2", "tiny", checkpoint="/ckpt/Kimi-K2_tiny", dtype="float32")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weightsync.models.config import ConfigError, architecture_of, checkpoint_fp8_block, spec_from_hf_config
from weightsync.models.registry import get_model, parse_scale, scale_spec
from weightsync.models.spec import ModelSpec

CONFIG_FILE = "config.json"
DTYPES = ("bfloat16", "float32", "float16")
"""Weight dtypes of ``--dtype`` (trainer and engine; fp8 weights stay fp8 in the engine)."""

_ACCEPTS = {"GlmMoeDsaForCausalLM": ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM")}
"""Registry architecture -> checkpoint architectures served by its profiles (default: itself)."""


def accepted_architectures(model: str) -> tuple[str, ...]:
    """The checkpoint architectures a registry model's profile serves."""
    arch = get_model(model).hf_architecture
    return _ACCEPTS.get(arch, (arch,))


def read_config(checkpoint: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory.

    Raises:
        ConfigError: not a directory, no config.json, or not a JSON object (the message names the file).
    """
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} is not a directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ConfigError(f"checkpoint {path} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not readable as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def check_dtype(dtype: str) -> str:
    """``dtype`` when it is one of :data:`DTYPES`.

    Raises:
        ValueError: anything else.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def model_spec(model: str, scale: str = "full", *, checkpoint: str | Path | None = None,
               dtype: str = "bfloat16") -> ModelSpec:
    """The spec of a run of registry model ``model``: its registry shapes at ``scale``, or the
    checkpoint's (see the module docstring).

    Args:
        model: registry name (the run profile).
        scale: ``full``, ``tiny`` or ``layers=N``.
        checkpoint: an HF checkpoint directory, or None.
        dtype: the weights' dtype (:data:`DTYPES`).

    Returns:
        The spec; its name is ``model``; its ``fp8_block`` is None for a profile without fp8, else
        a block-fp8 checkpoint's own block (``quantization_config.weight_block_size``), else the
        profile's (weights quantized on load).

    Raises:
        ValueError: unknown model, scale or dtype; :class:`ConfigError` for a checkpoint whose
            config.json is missing, of another family, or has a field the engine cannot honour.
    """
    check_dtype(dtype)
    kind, n = parse_scale(scale)
    if checkpoint is None:
        return get_model(model, scale).replace(dtype=dtype)
    profile = get_model(model, "tiny" if kind == "tiny" else "full")
    where = str(Path(checkpoint) / CONFIG_FILE)
    config = read_config(checkpoint)
    arch = architecture_of(config, where)
    accepts = accepted_architectures(model)
    if arch not in accepts:
        from weightsync.models.config import ARCHITECTURES

        family = ARCHITECTURES[arch].value
        raise ConfigError(f"checkpoint {checkpoint} is a {arch} ({family} family); {model} serves "
                          f"{' or '.join(accepts)} checkpoints: pick the registry model of that family "
                          "(weightsync list)")
    # an fp8 profile serves a block-fp8 checkpoint in the checkpoint's own blocks (as sglang does)
    block = profile.fp8_block
    if block is not None:
        block = checkpoint_fp8_block(config.get("quantization_config"), where) or block
    spec = spec_from_hf_config(config, name=model, where=where, dtype=dtype, fp8_block=block,
                               sources={"*": where, "profile": f"registry model {model}"})
    if kind == "layers":
        assert n is not None
        try:
            return scale_spec(spec, scale)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return spec.replace(scale=scale)


def profile_fp8_block(model: str, scale: str = "full") -> tuple[int, int] | None:
    """The block registry model ``model``'s run profile serves fp8 weights in at ``scale`` (None: no
    fp8): the block an engine re-blocks a checkpoint's fp8 weights into where a shard cuts their own."""
    return get_model(model, "tiny" if parse_scale(scale)[0] == "tiny" else "full").fp8_block


def describe_model(spec: ModelSpec, checkpoint: str | Path | None = None) -> str:
    """What a command serves or trains, in words: ``checkpoint my-qwen (Qwen3ForCausalLM: 3
    layers, hidden 48, 6 heads, vocab 120), run profile Qwen3-4B`` for a checkpoint (named by its
    directory; ``spec`` is its own, from :func:`model_spec`), else ``Qwen3-4B at tiny scale (...)``
    for the registry's shapes (synthetic weights)."""
    dims = (f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads, "
            f"vocab {spec.vocab_size}" + (f", {spec.num_experts} experts" if spec.num_experts else ""))
    if checkpoint is None:
        return f"{spec.name} at {spec.scale} scale ({dims})"
    kind, n = parse_scale(spec.scale)
    first = f"; its first {n} layers" if kind == "layers" else ""
    return f"checkpoint {Path(checkpoint).name} ({spec.hf_architecture}: {dims}{first}), run profile {spec.name}"
