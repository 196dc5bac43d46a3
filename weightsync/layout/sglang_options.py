"""The layout choices sglang makes for a model on an engine, as named options.

sglang 0.5.23 (python/sglang/srt/) registers different parameters for the same model depending on
the model's config, the GPU, the engine's flags and its version. Each such choice is an option
of :class:`~weightsync.models.parallel.RolloutParallel`; ``None`` there means "sglang 0.5.23's rule
on a CUDA engine of compute capability 8.0 or more" (the GPUs the reference system runs on),
resolved here for a model by :func:`layout_options`; a value given (from what an engine
publishes, :func:`options_from_table`, or an engine's own flags) overrides the rule.

* ``router_fp32`` -- the MoE router ``mlp.gate.weight`` in float32: ``Glm4MoeGate``
  (``models/glm4_moe.py``) and ``Glm4MoeLiteGate`` (``models/glm4_moe_lite.py``) always;
  DeepSeek's ``MoEGate`` (``models/deepseek_v2.py``; Kimi-K2, GLM-5) when config.json says
  ``router_fp32``; Qwen3-MoE's ``ReplicatedLinear`` gate never. sglang 0.5.16 keeps the GLM
  routers in the model dtype and caches a float32 copy on the first forward that no update ever
  refreshes (:func:`stale_router_warning`).
* ``dsa_indexer_fusion`` -- the DSA indexer's ``wk`` and ``weights_proj`` as one ``ReplicatedLinear``
  ``wk_weights_proj`` in bfloat16, rows ``[wk; weights_proj]``
  (``layers/attention/dsa/dsa_indexer.py`` ``Indexer.__init__``: ``use_dsa_indexer_fusion = _is_cuda
  and not SGLANG_DISABLE_DSA_INDEXER_FUSION and not is_neox_style``, ``is_neox_style = not
  config.indexer_rope_interleave``, ``models/deepseek_v2.py``; filled by
  ``deepseek_weight_loader._load_fused_indexer_wk``). Unfused, ``weights_proj`` is bfloat16 all
  the same (``params_dtype=torch.bfloat16``) and ``wk`` the model dtype.
* ``shared_experts_fusion`` -- the shared expert as routed-expert slot ``E`` (after the routed
  ones) of ``w13_weight`` / ``w2_weight``, no ``mlp.shared_experts.*``
  (``layers/moe/utils.py`` ``resolve_shared_experts_config``, asked before the model is built: off
  with ``--disable-shared-experts-fusion`` or when the model class's
  ``shared_experts_fusion_disable_reason`` gives one; the loader renames ``mlp.shared_experts`` to
  ``mlp.experts.{n_routed_experts}``, ``FusedMoE._map_global_expert_id_to_local_expert_id`` puts it
  after the local routed experts). The reasons, on CUDA with default flags: ``Glm4MoeForCausalLM``
  (``models/glm4_moe.py``) fuses at ``moe_ep_size == 1``; ``Glm4MoeLiteForCausalLM``
  (``models/glm4_moe_lite.py``) with one shared expert at ``moe_ep_size == 1``;
  ``DeepseekV2ForCausalLM`` (``models/deepseek_v2.py``) only for the architecture it names
  (``DeepseekV3ForCausalLM``; ``GlmMoeDsaForCausalLM`` for its GLM-5 subclass; never
  ``DeepseekV32ForCausalLM``, which inherits DeepSeek-V3's name), 256 routed experts (384 only
  with Quark quantization: never Kimi-K2), one shared expert, ``moe_ep_size == 1``. sglang's
  ``--enforce-shared-experts-fusion`` (fusion under expert parallelism, shared slots scaled by
  ``1 / ep``) is not modelled: refused.

Settings of sglang's ``ServerArgs`` that change the layout in ways not modelled here are refused
when an engine reports them (:func:`check_server_args`), naming the setting: redundant experts
(EPLB), expert re-placement, all-to-all MoE backends, ... (:data:`UNSUPPORTED_SETTINGS`).

Typical usage::

    opts = layout_options(spec, RolloutParallel(tp=8, ep=8))
    opts.router_fp32        # True for GLM-4.5-Air
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import Family, ModelSpec

GLM_ROUTER_ARCHITECTURES = ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
"""Architectures whose router sglang 0.5.23 always holds in float32 (``Glm4MoeGate``, ``Glm4MoeLiteGate``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutOptions:
    """The options of one engine layout, resolved for a model (module docstring)."""

    router_fp32: bool
    """``mlp.gate.weight`` in float32 (else the model dtype)."""
    dsa_indexer_fusion: bool
    """``indexer.wk_weights_proj.weight`` instead of ``indexer.wk.weight`` and ``indexer.weights_proj.weight``."""
    shared_experts_fusion: bool
    """The shared expert is the last slot of each MoE layer's ``w13_weight`` / ``w2_weight``."""


UNSUPPORTED_SETTINGS: tuple[tuple[str, object, str], ...] = (
    ("ep_num_redundant_experts", 0, "redundant experts add physical expert slots that the EPLB metadata maps to "
     "logical experts (num_experts + ep_num_redundant_experts in FusedMoE)"),
    ("enable_eplb", False, "EPLB moves experts between slots while the engine runs"),
    ("init_expert_location", "trivial", "experts are not placed in order on the EP ranks"),
    ("moe_a2a_backend", "none", "an all-to-all MoE backend replicates or re-shards the shared experts"),
    ("enable_shared_experts_attn_tp", False, "shared experts split over attention-TP"),
    ("shared_experts_tp_size", None, "shared experts split over another TP size"),
    ("enable_dense_mlp_attn_tp", False, "dense MLPs split over attention-TP"),
    ("rl_on_policy_target", None, "Qwen3's norms and embedding held in float32"),
    ("attn_cp_size", 1, "attention context parallelism"),
    ("moe_dp_size", 1, "MoE data parallelism"),
    ("dcp_size", 1, "decode context parallelism (attn_mqa_for_dcp_decode scales)"),
)
"""``ServerArgs`` fields (sglang 0.5.23, ``arg_groups/fields/``) whose non-default values change the
parameters in ways the layout does not model: (field, default, what it changes)."""


def check_server_args(info: Mapping[str, object]) -> None:
    """Refuse an engine whose ``/server_info`` sets one of :data:`UNSUPPORTED_SETTINGS` (a field
    absent from the answer is at its default: older releases, this project's engine).

    Raises:
        ValueError: one line naming the first such setting, its value and what it changes.
    """
    for key, default, what in UNSUPPORTED_SETTINGS:
        value = info.get(key, default)
        if value != default and not (value is None and default in (0, False)):
            raise ValueError(f"the engine runs with {key}={value!r}: {what}, which weightsync does not plan for "
                             f"(restart it with {key} {default!r})")


def sglang_router_fp32(spec: ModelSpec) -> bool:
    """sglang 0.5.23's router dtype rule: float32 for the GLM gates, ``config.router_fp32`` for
    DeepSeek's ``MoEGate``, the model dtype for Qwen3-MoE."""
    if spec.hf_architecture in GLM_ROUTER_ARCHITECTURES:
        return True
    return spec.family is Family.DEEPSEEK_V3 and spec.router_fp32


def sglang_shared_experts_fusion(spec: ModelSpec, par: RolloutParallel) -> bool:
    """sglang 0.5.23's shared-experts fusion rule on a CUDA GPU of compute capability 8.0 or more
    with default flags (module docstring)."""
    if not spec.num_shared_experts or par.ep != 1:
        return False
    arch = spec.hf_architecture
    if arch == "Glm4MoeForCausalLM":
        return True
    if arch == "Glm4MoeLiteForCausalLM":
        return spec.num_shared_experts == 1
    if arch in ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM"):
        return spec.num_shared_experts == 1 and spec.num_experts == 256
    return False


def layout_options(spec: ModelSpec, par: RolloutParallel) -> LayoutOptions:
    """The options of ``par`` for ``spec``: each given value, else sglang 0.5.23's rule.

    Args:
        spec: the model.
        par: the engine's parallel sizes and options.

    Returns:
        The resolved :class:`LayoutOptions`.

    Raises:
        ValueError: an option sglang cannot have for this model (named).
    """
    router = par.router_fp32 if par.router_fp32 is not None else sglang_router_fp32(spec)
    fused = par.dsa_indexer_fusion if par.dsa_indexer_fusion is not None else spec.indexer_rope_interleave
    if fused and spec.has_indexer and not spec.indexer_rope_interleave:
        raise ValueError(f"{spec.name}: dsa_indexer_fusion needs the interleaved indexer rope (sglang fuses wk and "
                         "weights_proj only when config.json sets indexer_rope_interleave)")
    shared = (par.shared_experts_fusion if par.shared_experts_fusion is not None
              else sglang_shared_experts_fusion(spec, par)) and spec.num_shared_experts > 0
    if shared and par.ep > 1:
        raise ValueError(f"{spec.name}: shared-expert fusion under expert parallelism (ep {par.ep}; sglang's "
                         "--enforce-shared-experts-fusion) is not supported: serve with ep 1 or without the fusion")
    if shared and spec.num_shared_experts != 1:
        raise ValueError(f"{spec.name}: shared-expert fusion of {spec.num_shared_experts} shared experts is not "
                         "supported (one slot per shared expert of width moe_intermediate_size)")
    return LayoutOptions(router_fp32=bool(spec.is_moe and router), dsa_indexer_fusion=bool(spec.has_indexer and fused),
                         shared_experts_fusion=shared)


def _first_moe_layer(spec: ModelSpec) -> int | None:
    return next((layer for layer in range(spec.num_layers) if spec.is_moe_layer(layer)), None)


def options_from_table(spec: ModelSpec, par: RolloutParallel, weights: Mapping[str, Sequence[int]]) -> RolloutParallel:
    """``par`` with every option an engine's published parameter table shows set to what it shows.

    ``weights`` is one rank's ``{name: [ptr, numel, element_size]}``
    (``/get_remote_instance_transfer_engine_info``, sglang's ``model.named_parameters()``). An
    option the table says nothing about (its parameters are not there) keeps ``par``'s value.

    Args:
        spec: the model.
        par: the engine's parallel sizes (from ``/server_info``).
        weights: the table of any rank of the engine.

    Returns:
        ``par`` with the options the table decides.
    """
    changes: dict[str, object] = {}
    layer = _first_moe_layer(spec)
    if layer is not None:
        gate = weights.get(f"model.layers.{layer}.mlp.gate.weight")
        if gate is not None:
            changes["router_fp32"] = int(gate[2]) == 4
        shared = weights.get(f"model.layers.{layer}.mlp.shared_experts.gate_up_proj.weight")
        if spec.num_shared_experts and f"model.layers.{layer}.mlp.experts.w13_weight" in weights:
            changes["shared_experts_fusion"] = shared is None
    if spec.has_indexer:
        ix = "model.layers.0.self_attn.indexer."
        if ix + "wk_weights_proj.weight" in weights:
            changes["dsa_indexer_fusion"] = True
        elif ix + "wk.weight" in weights:
            changes["dsa_indexer_fusion"] = False
    return replace(par, **changes) if changes else par


def stale_router_warning(spec: ModelSpec, par: RolloutParallel, version: str | None) -> str | None:
    """The warning an update into an engine with sglang 0.5.16's GLM router deserves, or None.

    sglang 0.5.16's ``Glm4MoeGate`` / ``Glm4MoeLiteGate`` hold the router in the model dtype and
    compute with a float32 copy made on the first forward and never refreshed (a non-persistent
    ``_weight_fp32`` buffer): every update writes the router, and the engine goes on routing with
    the weights it started with. Such an engine publishes the router in the model dtype
    (``router_fp32`` False for a GLM architecture).

    Args:
        spec: the model.
        par: the engine's layout, options as the engine published them.
        version: the engine's ``/server_info`` ``version`` (for the message).
    """
    if spec.hf_architecture not in GLM_ROUTER_ARCHITECTURES or not spec.is_moe:
        return None
    if layout_options(spec, par).router_fp32:
        return None
    return (f"the engine (sglang {version or 'of unknown version'}) holds the {spec.hf_architecture} router "
            f"mlp.gate.weight in {spec.dtype}: sglang 0.5.16 computes with a float32 copy made once, on its first "
            "forward, so the router weights this update writes are ignored until the engine restarts "
            "(sglang 0.5.23 holds the router in float32 and has no such copy)")
