"""Megatron-core adapter: build a ``GPTModel`` of a registry model, and describe a live one.

The model is built from its :class:`ModelSpec` with megatron-core's *local* layer spec (no
Transformer Engine): ``ColumnParallelLinear`` / ``RowParallelLinear``, RMSNorm modules,
``SequentialMLP`` experts, shared experts, a softmax or sigmoid router with an optional expert
bias, q/k layernorm, qkv bias, partial rotary, and MLA (``MLATransformerConfig``) for the
DeepSeek-V3 family. Where the local spec cannot build a piece (MLA's core attention, GLM-5's DSA
indexer) :mod:`weightsync.sources.megatron_modules` fills the slot without changing the
parameter layout.

Choices, each matching how Megatron-LM trains these models as far as weights go:

* parameters in ``spec.dtype`` (Megatron-LM's ``Float16Module`` casts the model to bf16), the
  router's ``expert_bias`` buffer in float32;
* sequence parallelism as ``par.sequence_parallel`` says (when TP > 1), with weightsync's
  :class:`RMSNormSP` norms (the local spec's torch norms refuse it); it changes no weight;
* vocab padded to a multiple of ``128 * tp`` (``--make-vocab-size-divisible-by 128``);
* ``moe_layer_freq`` an int when every layer is MoE, else the ``[0]*k + [1]*n`` list (as miles
  passes it), which also decides the checkpoint key style (:mod:`weightsync.sources.dist_layout`).

Not built: ``TrainParallel.mla_down_proj_replicated`` (the TE spec's duplicated MLA down
projections). ``MLASelfAttention`` builds a down projection whole only as Transformer Engine's
``TELinear`` (or modelopt's ``Linear``, importable only with TE); with the local spec's
``ColumnParallelLinear`` it is TP-split. :func:`build_gpt_model` refuses that configuration
rather than build a model whose shards differ from the layout; its torch_dist checkpoint is the
same either way, so a live model reads it with the setting off.

megatron-core 0.16.1 assumes CUDA and Transformer Engine in a few places while it builds;
:func:`megatron_compat` works around them (see there), which lets every family, MLA
included, be built and run on a CPU machine.

Typical usage (inside an initialized process group of ``par.world_size`` ranks)::

    init_parallel_state(par)
    model = build_gpt_model(spec, par, rank, device="cpu")
    layout = check_against_layout(model, spec, par, rank)   # param name -> LocalTensor
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from weightsync.layout.box import LocalTensor
from weightsync.layout.megatron import MAKE_VOCAB_SIZE_DIVISIBLE_BY, train_coords, trainer_layout
from weightsync.layout.megatron_pieces import padded_vocab_size
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.sources.dist_layout import homogeneous_layers, tp_split
from weightsync.sources.torch_dist import torch_dtype


@contextlib.contextmanager
def megatron_compat() -> Iterator[None]:
    """Work around megatron-core 0.16.1's assumptions of CUDA and Transformer Engine.

    Enter it around building, saving and running a model on a machine that lacks either:

    * without CUDA, ``torch.cuda.current_device()`` (asked for the device of the router's
      buffers and weight, and of rotary frequencies) answers ``"cpu"``, and the model-parallel
      RNG tracker's ``fork()`` (entered around dropout under sequence parallelism; it holds CUDA
      generator states) is a no-op: weightsync's models have no dropout;
    * without Transformer Engine, megatron-core's TE extension still imports (with placeholder
      classes), so ``multi_latent_attention.HAVE_TE`` is True and an ``isinstance`` test
      against a placeholder fails: it is False for the duration; and ``moe_utils`` ends up
      without a ``te_general_gemm`` name, which the router's gating reads: it is set to None
      (the value megatron-core means when TE is absent).
    """
    import importlib.util

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            original = torch.cuda.current_device
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
            stack.callback(setattr, torch.cuda, "current_device", original)
            tracker = get_cuda_rng_tracker()
            tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[method-assign]
            stack.callback(delattr, tracker, "fork")
        if importlib.util.find_spec("transformer_engine") is None:
            have_te = multi_latent_attention.HAVE_TE
            multi_latent_attention.HAVE_TE = False
            stack.callback(setattr, multi_latent_attention, "HAVE_TE", have_te)
        yield


def init_parallel_state(par: TrainParallel, *, order: str = "tp-cp-ep-dp-pp", seed: int = 1234) -> None:
    """Initialize megatron-core's parallel groups for ``par`` (torch.distributed must be up).

    On CUDA also seeds megatron-core's model-parallel RNG tracker (``model_parallel_cuda_manual_seed``),
    which its forward needs under sequence parallelism. Hangs unless every rank of the job calls
    it. Pair with :func:`destroy_parallel_state`.
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp, context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.etp, order=order)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    """Tear down megatron-core's parallel groups (the process group itself stays)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def transformer_config(spec: ModelSpec, par: TrainParallel, *, dtype: torch.dtype | None = None,
                       device: str = "cpu", moe_dispatcher: str = "allgather") -> object:
    """The megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for MLA) of ``spec``.

    Args:
        spec: the model.
        par: parallel sizes.
        dtype: parameter dtype (default ``spec.dtype``).
        device: ``"cpu"`` (CPU initialization) or ``"cuda"``.
        moe_dispatcher: ``moe_token_dispatcher_type``.

    Returns:
        The config.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = dtype if dtype is not None else torch_dtype(spec.dtype)
    kw: dict[str, object] = {
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "ffn_hidden_size": spec.intermediate_size or spec.moe_intermediate_size, "normalization": "RMSNorm",
        "layernorm_epsilon": spec.rms_norm_eps, "gated_linear_unit": True, "activation_func": F.silu,
        "add_bias_linear": False, "add_qkv_bias": spec.attention_bias, "qk_layernorm": spec.qk_norm or spec.is_mla,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "tensor_model_parallel_size": par.tp,
        "pipeline_model_parallel_size": par.pp, "context_parallel_size": par.cp,
        "expert_model_parallel_size": par.ep, "expert_tensor_parallel_size": par.etp,
        "num_layers_in_last_pipeline_stage": par.pp_last_stage_layers,
        "sequence_parallel": par.sequence_parallel and par.tp > 1,
        "params_dtype": dtype, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16,
        "pipeline_dtype": dtype, "use_cpu_initialization": device == "cpu", "perform_initialization": True,
        "masked_softmax_fusion": False, "bias_activation_fusion": False, "bias_dropout_fusion": False,
        "apply_rope_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
        "attention_softmax_in_fp32": True,
    }
    _check_megatron_can_build(spec)
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts, moe_router_topk=spec.num_experts_per_tok,
            moe_ffn_hidden_size=spec.moe_intermediate_size,
            moe_shared_expert_intermediate_size=(spec.num_shared_experts * spec.moe_intermediate_size) or None,
            moe_router_score_function=spec.router_score_function,
            moe_router_enable_expert_bias=spec.router_expert_bias,
            moe_router_pre_softmax=spec.router_score_function == "softmax" and not spec.norm_topk_prob,
            moe_router_topk_scaling_factor=spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else None,
            moe_layer_freq=1 if homogeneous_layers(spec) else [int(spec.is_moe_layer(i))
                                                               for i in range(spec.num_layers)],
            moe_token_dispatcher_type=moe_dispatcher, moe_grouped_gemm=False,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        )
        if spec.n_group > 1:
            kw.update(moe_router_num_groups=spec.n_group, moe_router_group_topk=spec.topk_group)
    y = spec.rope_scaling
    yarn = {} if y is None else {
        "rotary_scaling_factor": y.factor, "original_max_position_embeddings": y.original_max_position_embeddings,
        "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale or 1.0,
        "mscale_all_dim": y.mscale_all_dim or 0.0}
    if not spec.is_mla:
        config = TransformerConfig(num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, **kw)
        for key, value in yarn.items():  # GPTModel's yarn embedding reads Megatron-LM's --yarn-* values
            setattr(config, "yarn_" + key, value)
        if yarn:
            config.yarn_correction_range_round_to_int = True
        return config
    return MLATransformerConfig(
        q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim,
        qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
        rope_type="yarn" if yarn else "rope", rotary_base=spec.rope_theta, **yarn, **kw)


def _check_megatron_can_build(spec: ModelSpec) -> None:
    """Refuse a spec whose forward megatron-core would compute differently (naming the field).

    Raises:
        ValueError: MLA rope rows rotated as halves (Megatron's MLA always de-interleaves pairs), a
            YaRN setting Megatron's YaRN embedding has no knob for, or group-limited routing whose
            group score is not Megatron's (the sum of each group's top ``topk / group_topk`` scores).
    """
    if spec.is_mla and not spec.rope_interleave:
        raise ValueError(f"{spec.name}: rope_interleave=False: megatron-core's MLA rotates rope dims in pairs")
    y = spec.rope_scaling
    if y is not None:
        if y.attention_factor is not None or not y.truncate:
            raise ValueError(f"{spec.name}: rope scaling attention_factor/truncate=False has no megatron-core setting")
        if bool(y.mscale) != bool(y.mscale_all_dim) and y.mscale_all_dim:
            raise ValueError(f"{spec.name}: rope scaling mscale_all_dim={y.mscale_all_dim} without mscale: "
                             "megatron-core scales cos/sin by the mscale ratio")
    if spec.is_moe and spec.n_group > 1:
        per_group = spec.num_experts_per_tok // spec.topk_group
        if per_group != (2 if spec.router_expert_bias else 1):
            raise ValueError(f"{spec.name}: n_group={spec.n_group}, topk_group={spec.topk_group}: megatron-core "
                             f"scores a group by its top {per_group} experts, the checkpoint's router by its "
                             f"{'top 2' if spec.router_expert_bias else 'best'}")


def _block_spec(config: object, spec: ModelSpec, pp_rank: int) -> object:
    """The local-spec decoder block of one PP stage, with weightsync's core attention and norms.

    :class:`SdpaCoreAttention` replaces ``DotProductAttention`` (which serves neither MLA nor a
    CPU forward: it allocates its causal mask on CUDA) and :class:`RMSNormSP` replaces the local
    norm (``WrappedTorchNorm`` refuses sequence parallelism). Neither changes a parameter.
    """
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from weightsync.sources.megatron_modules import RMSNormSP, SdpaCoreAttention

    block = copy.deepcopy(get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                     pp_rank=pp_rank))
    core: object = SdpaCoreAttention  # SelfAttention calls the class directly
    if spec.is_mla:  # MLASelfAttention goes through build_module
        indexer = None
        if spec.has_indexer:
            q_in = spec.q_lora_rank if spec.q_lora_rank is not None else spec.hidden_size
            indexer = {"q_lora_rank": q_in, "num_heads": spec.index_n_heads, "head_dim": spec.index_head_dim}
        core = ModuleSpec(module=SdpaCoreAttention, params={"indexer": indexer})
    for layer_spec in block.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = core
    _replace_class(block, LNImpl, RMSNormSP)  # WrappedTorchNorm (or Apex's FusedLayerNorm when installed)
    return block


def _replace_class(node: object, old: type, new: type) -> None:
    """Replace ``old`` by ``new`` in every field of a (nested) spec dataclass, in place."""
    import dataclasses

    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if value is old:
            setattr(node, f.name, new)
        elif isinstance(value, list):
            for item in value:
                _replace_class(item, old, new)
        else:
            _replace_class(value, old, new)


def build_gpt_model(spec: ModelSpec, par: TrainParallel, rank: int, *, device: str = "cpu",
                    dtype: torch.dtype | None = None, expert_naming: str = "sequential",
                    moe_dispatcher: str = "allgather") -> torch.nn.Module:
    """Build this rank's megatron-core ``GPTModel`` of ``spec`` (randomly initialized).

    Needs megatron-core's parallel state for ``par`` (:func:`init_parallel_state`).

    Args:
        spec: the model.
        par: parallel sizes.
        rank: this process's global trainer rank (decides its PP stage).
        device: ``"cpu"`` or ``"cuda"`` (the current CUDA device).
        dtype: parameter dtype (default ``spec.dtype``).
        expert_naming: only ``"sequential"`` (the local spec's ``SequentialMLP``); grouped
            experts need Transformer Engine.
        moe_dispatcher: ``moe_token_dispatcher_type``.

    Returns:
        The model, its parameters in ``dtype`` and the router ``expert_bias`` buffers in float32.

    Raises:
        ValueError: an unsupported expert naming, duplicated MLA down projections (they need
            Transformer Engine), or a configuration the layout refuses.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    if spec.is_mla and par.mla_down_proj_replicated:
        raise ValueError(f"{spec.name}: mla_down_proj_replicated (the TE spec's duplicated linear_q_down_proj / "
                         "linear_kv_down_proj) cannot be built with megatron-core's local spec, whose MLA down "
                         "projections are ColumnParallelLinear (TP-split); build the model with "
                         "mla_down_proj_replicated=False (it reads the same torch_dist checkpoint)")
    if expert_naming != "sequential":
        raise ValueError(f"expert_naming={expert_naming!r} needs Transformer Engine's TEGroupedMLP; "
                         "the local-spec model has SequentialMLP experts (use 'sequential')")
    trainer_layout(spec, par, rank)  # the same config checks, with weightsync's messages
    dtype = dtype if dtype is not None else torch_dtype(spec.dtype)
    config = transformer_config(spec, par, dtype=dtype, device=device, moe_dispatcher=moe_dispatcher)
    pp_rank = train_coords(par, rank).pp
    with megatron_compat():
        model = GPTModel(
            config=config, transformer_layer_spec=_block_spec(config, spec, pp_rank),
            vocab_size=padded_vocab_size(spec.vocab_size, par.tp, MAKE_VOCAB_SIZE_DIVISIBLE_BY),
            max_sequence_length=spec.max_position_embeddings, pre_process=pp_rank == 0,
            post_process=pp_rank == par.pp - 1, share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="yarn" if spec.rope_scaling is not None and not spec.is_mla else "rope",
            rotary_percent=spec.partial_rotary_factor,
            rotary_base=int(spec.rope_theta))
    model.to(device=device if device == "cpu" else torch.cuda.current_device(), dtype=dtype)
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            buf.data = buf.data.float()
    return model


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, each router ``expert_bias`` buffer right after its router weight
    (the order of :func:`trainer_layout`)."""
    buffers = {n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p
        bias = name.removesuffix("weight") + "expert_bias"
        if name.endswith("router.weight") and bias in buffers:
            out[bias] = buffers[bias]
    return out


def check_against_layout(model: torch.nn.Module, spec: ModelSpec, par: TrainParallel, rank: int, *,
                         expert_naming: str = "sequential", check_dtype: bool = True) -> dict[str, LocalTensor]:
    """Check a live model against the trainer layout; return the layout by parameter name.

    Compared per parameter: the name and order, the shape, the dtype (unless ``check_dtype`` is
    False), and Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes against
    :func:`tp_split`.

    Args:
        model: this rank's ``GPTModel``.
        spec, par, rank, expert_naming: as in :func:`trainer_layout`.
        check_dtype: compare dtypes too (a model built in float32 for checks differs).

    Returns:
        Parameter name -> :class:`LocalTensor` (its pieces of HF global tensors).

    Raises:
        ValueError: listing every difference.
    """
    layout = trainer_layout(spec, par, rank, expert_naming=expert_naming)
    live = model_tensors(model)
    problems = []
    if list(live) != [t.name for t in layout]:
        missing = [t.name for t in layout if t.name not in live]
        extra = [n for n in live if n not in {t.name for t in layout}]
        problems.append(f"names differ: missing {missing[:10]}, unexpected {extra[:10]}"
                        + ("" if missing or extra else " (order differs)"))
    for t in layout:
        p = live.get(t.name)
        if p is None:
            continue
        if tuple(p.shape) != t.shape:
            problems.append(f"{t.name}: shape {list(p.shape)} != layout {list(t.shape)}")
        if check_dtype and p.dtype != torch_dtype(t.dtype):
            problems.append(f"{t.name}: dtype {p.dtype} != layout {t.dtype}")
        want = tp_split(spec, t.name, mla_down_proj_replicated=par.mla_down_proj_replicated)
        got = (bool(getattr(p, "tensor_model_parallel", False)), getattr(p, "partition_dim", None))
        if isinstance(p, torch.nn.Parameter) and got != (want.tensor_model_parallel, want.partition_dim):
            problems.append(f"{t.name}: tensor_model_parallel/partition_dim {got} != expected "
                            f"{(want.tensor_model_parallel, want.partition_dim)}")
    if problems:
        raise ValueError(f"rank {rank}: the megatron-core model of {spec.name} differs from the trainer layout: "
                         + "; ".join(problems))
    return {t.name: t for t in layout}
