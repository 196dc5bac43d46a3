"""The trainer layout: Megatron-core parameters of one rank as pieces of the HF global tensors.

Target: ``GPTModel`` of megatron-core 0.16 built with the *local* layer spec
(``get_gpt_layer_local_spec`` / ``LocalSpecProvider``: no Transformer Engine), which is what
weightsync builds on CPU; ``TrainParallel.mla_down_proj_replicated`` switches the one
difference of the Transformer Engine spec that moves MLA weights (below). Names are exactly
those of ``GPTModel.named_parameters()`` on the rank (plus the router's ``expert_bias`` buffer),
in the same order:

* ``embedding.word_embeddings.weight`` on the first PP stage; ``decoder.final_layernorm.weight``
  and ``output_layer.weight`` on the last. Tied embeddings: with ``pp == 1`` there is no
  ``output_layer.weight``; with ``pp > 1`` the last stage keeps its own copy of the word
  embeddings as ``output_layer.weight`` (``LanguageModule.setup_embeddings_and_output_layer``
  all-reduces it from stage 0 and keeps it in sync through the embedding group), so its pieces
  are pieces of ``model.embed_tokens.weight`` as well.
* ``decoder.layers.{i}`` with ``i`` local to the stage (``TransformerBlock`` builds a
  ``ModuleList`` of the stage's layers only).
* Layer norms are separate modules (``input_layernorm``, ``pre_mlp_layernorm``,
  ``self_attention.q_layernorm`` / ``k_layernorm`` / MLA ``kv_layernorm``). The TE spec fuses
  them into ``linear_qkv.layer_norm_weight`` etc.; that layout is not modelled here.
* MLA with the local spec: ``linear_q_down_proj`` and ``linear_kv_down_proj`` are
  ``ColumnParallelLinear`` (TP-split rows, gathered in the forward). The TE spec
  (``get_gpt_layer_with_transformer_engine_spec``: ``backend.linear()`` = ``TELinear``, which
  ``MLASelfAttention.__init__`` builds with ``parallel_mode="duplicated"`` and no TP group)
  holds them whole on every TP rank: with ``par.mla_down_proj_replicated`` each is one piece
  covering the whole HF tensor (``q_a_proj`` / ``kv_a_proj_with_mqa``), as for a norm.
  Only this sharding is switched; names stay the local spec's (the TE spec also fuses
  ``q_layernorm`` / ``kv_layernorm`` into the up projections' ``layer_norm_weight``).
* GLM-5's DSA indexer: megatron-core 0.16 has it only behind a TE backend (its spec uses
  ``backend.linear()``, which ``LocalSpecProvider`` lacks). Its parameters are named as in
  that module tree, ``self_attention.core_attention.indexer.{linear_wq_b,linear_wk,k_norm,
  linear_weights_proj}`` (Megatron-Bridge's GLM-5 mapping uses the same names), replicated
  over TP, holding the HF tensors unchanged.
* Routed experts: ``expert_naming="sequential"`` (``SequentialMLP``, the local spec):
  ``mlp.experts.local_experts.{k}.linear_fc{1,2}.weight``; ``"grouped"`` (``TEGroupedMLP``):
  ``mlp.experts.linear_fc{1,2}.weight{k}``; ``k`` local to the EP rank. The legacy
  ``GroupedMLP`` (``weight1``/``weight2``, transposed and stacked) is not supported.
* ``mlp.router.weight`` has ``spec.dtype``: megatron-core creates it in float32, and
  ``Float16Module`` casts the model to bf16 for training. ``mlp.router.expert_bias`` stays
  float32 (``TopKRouter._maintain_float32_expert_bias``).

Typical usage::

    from weightsync.layout.megatron import trainer_layout
    tensors = trainer_layout(spec, TrainParallel(world_size=8, tp=2, ep=4), rank=3)
"""

from __future__ import annotations

import functools

from weightsync.layout import megatron_pieces as mp
from weightsync.layout.box import LocalTensor, Piece
from weightsync.layout.megatron_ranks import DEFAULT_ORDER, TrainCoords, stage_layers, train_coords
from weightsync.models.hf import attention_tensors, mlp_tensors
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec

__all__ = ["EXPERT_NAMINGS", "MLA_DOWN_PROJ", "TrainCoords", "check_trainer_config", "stage_layers", "train_coords",
           "trainer_layout"]

EXPERT_NAMINGS = ("sequential", "grouped")
MLA_DOWN_PROJ = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
"""MLA parameters (names within ``self_attention.``) that ``TrainParallel.mla_down_proj_replicated``
keeps whole on every TP rank."""
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron's default ``--make-vocab-size-divisible-by``."""

Part = tuple[tuple[int, ...], tuple[Piece, ...]]  # (local shape, pieces)


def trainer_layout(spec: ModelSpec, par: TrainParallel, rank: int, *, expert_naming: str = "sequential",
                   vocab_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY,
                   order: str = DEFAULT_ORDER) -> list[LocalTensor]:
    """The local tensors of trainer rank ``rank``, each as pieces of HF global tensors.

    Args:
        spec: the model.
        par: the training job's Megatron parallel sizes.
        rank: global trainer rank in ``[0, par.world_size)``.
        expert_naming: ``"sequential"`` (local spec ``SequentialMLP``) or ``"grouped"``
            (``TEGroupedMLP``) names of the routed experts.
        vocab_divisible_by: Megatron's ``--make-vocab-size-divisible-by``; the vocab is padded
            to a multiple of it times TP.
        order: Megatron's rank order (``train_coords``).

    Returns:
        The rank's parameters in ``named_parameters()`` order (the ``expert_bias`` buffer right
        after ``router.weight``). The list is new; its :class:`LocalTensor` records are cached
        and shared between calls (they are frozen).

    Raises:
        ValueError: a configuration Megatron would refuse (see :func:`check_trainer_config`),
            a bad rank, or an unknown ``expert_naming``.
    """
    check_trainer_config(spec, par, expert_naming=expert_naming)
    if vocab_divisible_by < 1:
        raise ValueError(f"vocab_divisible_by must be >= 1, got {vocab_divisible_by}")
    c = train_coords(par, rank, order=order)
    stage = stage_layers(spec, par)[c.pp]
    first, last = c.pp == 0, c.pp == par.pp - 1
    out: list[LocalTensor] = []
    if first:
        out.append(_embedding(spec, par.tp, c.tp, vocab_divisible_by))
    for local, layer in enumerate(stage):
        head, tail = _layer_dense(spec, layer, local, par.tp, c.tp, par.mla_down_proj_replicated)
        out += head
        if spec.is_moe_layer(layer):
            out += _layer_experts(spec, layer, local, par.ep, par.etp, c.ep, c.etp, expert_naming)
        out += tail
    if last:
        out.append(_final_norm(spec))
        head_weight = _output_layer(spec, par.tp, c.tp, vocab_divisible_by, tied_copy=not first)
        if head_weight is not None:
            out.append(head_weight)
    return out


def check_trainer_config(spec: ModelSpec, par: TrainParallel, *, expert_naming: str = "sequential") -> None:
    """Refuse a (model, parallel config) pair that Megatron-core could not build.

    Raises:
        ValueError: naming the constraint that fails.
    """
    _check(spec, par, expert_naming)


@functools.lru_cache(maxsize=256)
def _check(spec: ModelSpec, par: TrainParallel, expert_naming: str) -> None:
    if expert_naming not in EXPERT_NAMINGS:
        raise ValueError(f"expert_naming must be one of {EXPERT_NAMINGS}, got {expert_naming!r}")
    stage_layers(spec, par)
    tp, name = par.tp, spec.name
    _divides(spec.num_attention_heads, tp, f"{name}: num_attention_heads", "tp")
    if spec.is_mla and not par.mla_down_proj_replicated:  # the local spec's ColumnParallelLinear
        hint = " (or keep the MLA down projections whole: mla_down_proj_replicated, as the TE spec does)"
        if spec.q_lora_rank is not None:
            _divides(spec.q_lora_rank, tp, f"{name}: q_lora_rank (linear_q_down_proj rows)", "tp", hint)
        _divides(spec.kv_lora_rank + spec.qk_rope_head_dim, tp,
                 f"{name}: kv_lora_rank + qk_rope_head_dim (linear_kv_down_proj rows)", "tp", hint)
    if not spec.is_mla:
        ng = spec.num_kv_heads
        if ng % tp and tp % ng:
            raise ValueError(f"{name}: num_kv_heads (query groups)={ng} must be a multiple or a divisor of tp={tp}")
        _divides((spec.num_attention_heads + 2 * ng) * spec.head_dim, tp, f"{name}: linear_qkv rows", "tp")
    if any(not spec.is_moe_layer(layer) for layer in range(spec.num_layers)):
        _divides(spec.intermediate_size, tp, f"{name}: intermediate_size", "tp")
    if spec.is_moe:
        _divides(spec.num_experts, par.ep, f"{name}: num_experts", "ep")
        _divides(spec.moe_intermediate_size, par.etp, f"{name}: moe_intermediate_size", "etp")
        _divides(spec.num_shared_experts * spec.moe_intermediate_size, tp,
                 f"{name}: shared expert size (num_shared_experts * moe_intermediate_size)", "tp")


def _divides(value: int, size: int, what: str, axis: str, hint: str = "") -> None:
    if value % size:
        raise ValueError(f"{what}={value} is not divisible by {axis}={size}{hint}")


def _tensor(name: str, part: Part, dtype: str) -> LocalTensor:
    shape, pieces = part
    return LocalTensor(name=name, shape=shape, dtype=dtype, pieces=pieces)


@functools.lru_cache(maxsize=4096)
def _layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Global tensor shapes of one layer, from the canonical table (``weightsync.models.hf``)."""
    p = f"model.layers.{layer}."
    shapes = {p + "input_layernorm.weight": (spec.hidden_size,)}
    shapes.update(attention_tensors(spec, p))
    shapes[p + "post_attention_layernorm.weight"] = (spec.hidden_size,)
    shapes.update(mlp_tensors(spec, layer, p))
    return shapes


@functools.lru_cache(maxsize=256)
def _embedding(spec: ModelSpec, tp: int, tp_rank: int, divisible_by: int) -> LocalTensor:
    g = "model.embed_tokens.weight"
    part = mp.vocab_rows(g, (spec.vocab_size, spec.hidden_size), tp_rank, tp, divisible_by)
    return _tensor("embedding.word_embeddings.weight", part, spec.dtype)


@functools.lru_cache(maxsize=256)
def _final_norm(spec: ModelSpec) -> LocalTensor:
    return _tensor("decoder.final_layernorm.weight", mp.whole("model.norm.weight", (spec.hidden_size,)), spec.dtype)


@functools.lru_cache(maxsize=256)
def _output_layer(spec: ModelSpec, tp: int, tp_rank: int, divisible_by: int, *, tied_copy: bool) -> LocalTensor | None:
    if spec.tie_word_embeddings and not tied_copy:
        return None  # pp == 1: the output layer reads embedding.word_embeddings.weight
    g = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    part = mp.vocab_rows(g, (spec.vocab_size, spec.hidden_size), tp_rank, tp, divisible_by)
    return _tensor("output_layer.weight", part, spec.dtype)


@functools.lru_cache(maxsize=65536)
def _layer_dense(spec: ModelSpec, layer: int, local: int, tp: int, tp_rank: int, down_replicated: bool) -> tuple[
    tuple[LocalTensor, ...], tuple[LocalTensor, ...]
]:
    """The TP-sharded and replicated tensors of one layer: (before the experts, after them).

    ``down_replicated``: MLA down projections whole on every TP rank (the TE spec).
    """
    shapes = _layer_shapes(spec, layer)
    g, l_ = f"model.layers.{layer}.", f"decoder.layers.{local}."
    dt = spec.dtype
    pre, post = g + "input_layernorm.weight", g + "post_attention_layernorm.weight"
    head = [_tensor(l_ + "input_layernorm.weight", mp.whole(pre, shapes[pre]), dt)]
    attn = _mla_attention(spec, shapes, g + "self_attn.", tp, tp_rank, down_replicated) if spec.is_mla else \
        _gqa_attention(spec, shapes, g + "self_attn.", tp, tp_rank)
    for n, part in attn:
        head.append(_tensor(l_ + "self_attention." + n, part, dt))
    head.append(_tensor(l_ + "pre_mlp_layernorm.weight", mp.whole(post, shapes[post]), dt))
    m, lm = g + "mlp.", l_ + "mlp."
    tail: list[LocalTensor] = []
    if not spec.is_moe_layer(layer):
        head += _mlp(lm, m, shapes, tp, tp_rank, dt)
        return tuple(head), ()
    head.append(_tensor(lm + "router.weight", mp.whole(m + "gate.weight", shapes[m + "gate.weight"]), dt))
    if spec.router_expert_bias:
        b = m + "gate.e_score_correction_bias"
        head.append(_tensor(lm + "router.expert_bias", mp.whole(b, shapes[b]), "float32"))
    if spec.num_shared_experts:
        tail += _mlp(lm + "shared_experts.", m + "shared_experts.", shapes, tp, tp_rank, dt)
    return tuple(head), tuple(tail)


def _mlp(local_prefix: str, global_prefix: str, shapes: dict[str, tuple[int, ...]], num_parts: int, part: int,
         dtype: str, *, suffix: str = "") -> list[LocalTensor]:
    """A gated MLP (dense, shared expert or one routed expert): ``linear_fc1`` + ``linear_fc2``.

    ``suffix`` is appended to the local names (``weight{k}`` of a TE grouped GEMM).
    """
    gate, up, down = (global_prefix + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj"))
    return [
        _tensor(f"{local_prefix}linear_fc1.weight{suffix}", mp.gated_fc1(gate, up, shapes[gate], part, num_parts),
                dtype),
        _tensor(f"{local_prefix}linear_fc2.weight{suffix}", mp.split_cols(down, shapes[down], part, num_parts),
                dtype),
    ]


def _gqa_attention(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], a: str, tp: int, r: int) -> list[
    tuple[str, Part]
]:
    """``SelfAttention`` (module order: linear_proj, linear_qkv, q_layernorm, k_layernorm)."""
    qkv = {"num_heads": spec.num_attention_heads, "num_groups": spec.num_kv_heads, "head_dim": spec.head_dim,
           "part": r, "num_parts": tp}
    out = [("linear_proj.weight", mp.split_cols(a + "o_proj.weight", shapes[a + "o_proj.weight"], r, tp)),
           ("linear_qkv.weight", mp.qkv_rows(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                                             trailing=(spec.hidden_size,), **qkv))]
    if spec.attention_bias:
        out.append(("linear_qkv.bias", mp.qkv_rows(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias",
                                                   trailing=(), **qkv)))
    if spec.qk_norm:
        out.append(("q_layernorm.weight", mp.whole(a + "q_norm.weight", shapes[a + "q_norm.weight"])))
        out.append(("k_layernorm.weight", mp.whole(a + "k_norm.weight", shapes[a + "k_norm.weight"])))
    return out


def _mla_attention(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], a: str, tp: int, r: int,
                   down_replicated: bool) -> list[tuple[str, Part]]:
    """``MLASelfAttention`` (module order: core_attention (the DSA indexer), linear_proj, q
    projections, kv projections, q_layernorm, kv_layernorm). The down projections are split by
    rows over TP (local spec) or, with ``down_replicated``, whole on every rank (TE spec)."""
    out: list[tuple[str, Part]] = []
    if spec.has_indexer:
        ix, lx = a + "indexer.", "core_attention.indexer."
        for local, glob in (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
                            ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
                            ("linear_weights_proj.weight", "weights_proj.weight")):
            out.append((lx + local, mp.whole(ix + glob, shapes[ix + glob])))
    out.append(("linear_proj.weight", mp.split_cols(a + "o_proj.weight", shapes[a + "o_proj.weight"], r, tp)))
    rows = [("linear_q_proj.weight", "q_proj.weight")] if spec.q_lora_rank is None else [
        ("linear_q_down_proj.weight", "q_a_proj.weight"), ("linear_q_up_proj.weight", "q_b_proj.weight")]
    rows += [("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
             ("linear_kv_up_proj.weight", "kv_b_proj.weight")]
    for local, glob in rows:
        if down_replicated and local in MLA_DOWN_PROJ:
            out.append((local, mp.whole(a + glob, shapes[a + glob])))
        else:
            out.append((local, mp.split_rows(a + glob, shapes[a + glob], r, tp)))
    if spec.q_lora_rank is not None:
        out.append(("q_layernorm.weight", mp.whole(a + "q_a_layernorm.weight", shapes[a + "q_a_layernorm.weight"])))
    out.append(("kv_layernorm.weight", mp.whole(a + "kv_a_layernorm.weight", shapes[a + "kv_a_layernorm.weight"])))
    return out


@functools.lru_cache(maxsize=65536)
def _layer_experts(spec: ModelSpec, layer: int, local: int, ep: int, etp: int, ep_rank: int, etp_rank: int,
                   naming: str) -> tuple[LocalTensor, ...]:
    """The routed experts of one EP rank: global experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``."""
    shapes = _layer_shapes(spec, layer)
    per = spec.num_experts // ep
    m, lm = f"model.layers.{layer}.mlp.", f"decoder.layers.{local}.mlp.experts."
    fc1s: list[LocalTensor] = []
    fc2s: list[LocalTensor] = []
    for k in range(per):
        prefix, suffix = (f"{lm}local_experts.{k}.", "") if naming == "sequential" else (lm, str(k))
        fc1, fc2 = _mlp(prefix, f"{m}experts.{ep_rank * per + k}.", shapes, etp, etp_rank, spec.dtype,
                        suffix=suffix)
        fc1s.append(fc1)
        fc2s.append(fc2)
    if naming == "sequential":  # local_experts.{k} modules, each with its fc1 then fc2
        return tuple(t for pair in zip(fc1s, fc2s, strict=True) for t in pair)
    return tuple(fc1s + fc2s)  # TE GroupedLinear modules linear_fc1 (weight0..) then linear_fc2
