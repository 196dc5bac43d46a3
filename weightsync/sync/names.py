"""Placing a trainer rank's live parameters on its trainer layout: both megatron-core layer specs.

A rank's parameters arrive under the names its training code uses. megatron-core 0.16 builds a
``GPTModel`` with one of two layer specs, and the names differ where the Transformer Engine (TE)
spec fuses modules:

===============================================  ============================================
TE spec                                          local spec (the trainer layout's names)
===============================================  ============================================
``L.self_attention.linear_qkv.layer_norm_weight``  ``L.input_layernorm.weight``
``L.mlp.linear_fc1.layer_norm_weight``           ``L.pre_mlp_layernorm.weight`` (dense layers)
``L.self_attention.linear_q_up_proj.layer_norm_weight``  ``L.self_attention.q_layernorm.weight`` (MLA)
``L.self_attention.linear_kv_up_proj.layer_norm_weight``  ``L.self_attention.kv_layernorm.weight`` (MLA)
``L.mlp.experts.linear_fc1.weight{i}`` (``TEGroupedMLP``)  ``L.mlp.experts.local_experts.{i}.linear_fc1.weight``
===============================================  ============================================

(``L`` = ``decoder.layers.{k}``; ``i`` is local to the EP rank in both.) Wrapper prefixes
(``module.`` of DDP / ``Float16Module``) are dropped, and so are ``_extra_state`` entries.

Every name is matched against the layout by **name** (after the aliases above), **shape** and
**role**: the role is the dimension along which the layout splits the tensor over TP (none for
a replicated one), read from the layout's pieces. A parameter's ``partition_dim`` attribute is
compared with it only where megatron-core sets it reliably: TE's attributes are wrong for
duplicated linears (MLA down projections, the DSA indexer: flagged ``partition_dim=0`` while
whole on every rank) and for expert linears with explicit communication (row-parallel
``linear_fc2`` reports dim 0), so replicated tensors and experts are matched by name and shape
only. A parameter that cannot be placed, a layout tensor with no parameter, a shape, dtype or
role that differs: each is an error naming the parameter, raised before anything moves.

Typical usage::

    params = place_params(model.named_parameters(), spec, train, rank)   # layout name -> tensor
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from weightsync.layout.box import LocalTensor
from weightsync.layout.megatron import trainer_layout
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec

WRAPPER_PREFIXES = ("module.",)
"""Prefixes that wrappers add to megatron-core's names (DDP, ``Float16Module``), dropped."""

_ALIASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(.*)\.self_attention\.linear_qkv\.layer_norm_weight$"), r"\1.input_layernorm.weight"),
    (re.compile(r"^(.*)\.mlp\.linear_fc1\.layer_norm_weight$"), r"\1.pre_mlp_layernorm.weight"),
    (re.compile(r"^(.*)\.self_attention\.linear_q_up_proj\.layer_norm_weight$"),
     r"\1.self_attention.q_layernorm.weight"),
    (re.compile(r"^(.*)\.self_attention\.linear_kv_up_proj\.layer_norm_weight$"),
     r"\1.self_attention.kv_layernorm.weight"),
    (re.compile(r"^(.*)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$"),
     r"\1.mlp.experts.local_experts.\3.linear_fc\2.weight"),
)
"""TE-spec name -> local-spec name (the module docstring's table)."""

_EXPERT = re.compile(r"\.mlp\.experts\.")


def layout_name(name: str) -> str | None:
    """The trainer-layout (local spec) name of a live parameter name; None for entries that are no
    weights (``_extra_state``)."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name[name.index(".") + 1:]
    if name.endswith("._extra_state") or name == "_extra_state":
        return None
    for pattern, repl in _ALIASES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def split_dim(tensor: LocalTensor, shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The dimension along which ``tensor`` holds only part of its global tensors (its TP role),
    None when every piece spans its global tensor whole along every dimension it maps."""
    for p in tensor.pieces:
        gshape = shapes[p.global_name]
        for d, ((a, b), n) in enumerate(zip(p.global_box, gshape, strict=True)):
            if (a, b) != (0, n):
                # a fused tensor (qkv, gate/up) is several row pieces: each is a row range
                return d if len(gshape) == len(tensor.shape) else None
    return None


def place_params(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], spec: ModelSpec,
                 train: TrainParallel, rank: int) -> dict[str, torch.Tensor]:
    """This rank's parameters by trainer-layout name, each checked against the layout.

    Args:
        named: ``(name, tensor)`` pairs (``model.named_parameters()``, plus buffers such as the
            router's ``expert_bias``) or a mapping; names of either megatron-core spec.
        spec: the model.
        train: the training job's parallel sizes.
        rank: this trainer rank.

    Returns:
        Layout name -> tensor (the live tensor itself, detached: no copy).

    Raises:
        ValueError: listing every parameter that cannot be placed (unknown name, two names for one
            layout tensor, another shape, dtype or TP role, not contiguous) and every layout tensor
            with no parameter.
    """
    items = named.items() if isinstance(named, Mapping) else named
    layout = {t.name: t for t in trainer_layout(spec, train, rank)}
    shapes = {g.name: g.shape for g in global_tensors(spec).values()}
    out: dict[str, torch.Tensor] = {}
    given: dict[str, str] = {}
    problems: list[str] = []
    for name, tensor in items:
        target = layout_name(name)
        if target is None:
            continue
        t = layout.get(target)
        shown = name if target == name else f"{name} (as {target})"
        if t is None:
            problems.append(f"{shown}: no such tensor on trainer rank {rank} of this layout")
            continue
        if target in given:
            problems.append(f"{shown}: also given as {given[target]}")
            continue
        given[target] = name
        problems += _mismatch(shown, tensor, t, shapes)
        out[target] = tensor.detach()
    missing = [n for n in layout if n not in out and n not in given]
    if missing:
        problems.append(f"no parameter for {len(missing)} layout tensors, e.g. {missing[:5]}")
    if problems:
        raise ValueError(f"trainer rank {rank}: cannot place the parameters of {spec.name} on its layout "
                         f"({train}): " + "; ".join(problems[:12])
                         + (f"; ... ({len(problems)} problems)" if len(problems) > 12 else ""))
    return {n: out[n] for n in layout}  # layout order


def _mismatch(shown: str, tensor: torch.Tensor, t: LocalTensor, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why ``tensor`` is not layout tensor ``t`` (empty when it is)."""
    out: list[str] = []
    if tuple(tensor.shape) != t.shape:
        out.append(f"{shown}: shape {list(tensor.shape)}, the layout has {list(t.shape)}")
    if str(tensor.dtype).removeprefix("torch.") != t.dtype:
        out.append(f"{shown}: dtype {tensor.dtype}, the layout has {t.dtype}")
    if not tensor.is_contiguous():
        out.append(f"{shown}: not contiguous (writes read parameter memory in place)")
    want = split_dim(t, shapes)
    if want is not None and not _EXPERT.search(t.name) and _attr(tensor, "tensor_model_parallel") is True:
        got = _attr(tensor, "partition_dim")
        if isinstance(got, int) and got != want:
            out.append(f"{shown}: partition_dim {got}, the layout splits it along dim {want}")
    return out


def _attr(tensor: torch.Tensor, name: str) -> Any:
    return getattr(tensor, name, None)


def module_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A megatron-core model's weights as the layout lists them: ``named_parameters()`` plus each
    router's ``expert_bias`` buffer (a float32 buffer that the engines hold as
    ``e_score_correction_bias``)."""
    out = list(model.named_parameters())
    out += [(n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    return out
