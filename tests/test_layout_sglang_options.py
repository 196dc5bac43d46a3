"""The layout options: each is sglang's rule by default, a given value overrides it, and a trainer
reads it from what an engine publishes.

Rules checked against the sglang 0.5.23 classes they come from (python/sglang/srt/):

* router dtype: ``models/glm4_moe.py`` ``Glm4MoeGate`` and ``models/glm4_moe_lite.py``
  ``Glm4MoeLiteGate`` create ``weight`` with ``dtype=torch.float32``; ``models/deepseek_v2.py``
  ``MoEGate`` with ``torch.float32 if getattr(config, "router_fp32", False) else
  torch.get_default_dtype()``; ``models/qwen3_moe.py``'s gate is a ``ReplicatedLinear`` in the
  model dtype. sglang 0.5.16's ``Glm4MoeGate`` holds the model dtype plus a ``_weight_fp32``
  cache filled on the first forward.
* DSA indexer: ``layers/attention/dsa/dsa_indexer.py`` ``Indexer.__init__``:
  ``use_dsa_indexer_fusion = _is_cuda and not SGLANG_DISABLE_DSA_INDEXER_FUSION and not
  is_neox_style`` (``is_neox_style = not config.indexer_rope_interleave``, ``models/deepseek_v2.py``);
  fused: ``wk_weights_proj = ReplicatedLinear(hidden, head_dim + n_heads, params_dtype=torch.bfloat16)``
  filled ``[wk; weights_proj]`` (``deepseek_weight_loader._load_fused_indexer_wk``); else ``wk``
  (quant_config, model dtype) and ``weights_proj`` (``params_dtype=torch.bfloat16``).
* shared-experts fusion: ``layers/moe/utils.py`` ``resolve_shared_experts_config`` asks the model
  class's ``shared_experts_fusion_disable_reason`` (``Glm4MoeForCausalLM``: CUDA and
  ``moe_ep_size == 1``; ``Glm4MoeLiteForCausalLM``: its architecture, ``n_shared_experts == 1``,
  ``moe_ep_size == 1``; ``DeepseekV2ForCausalLM``: ``architectures[0] ==
  fused_shared_experts_architecture`` (``DeepseekV3ForCausalLM``, ``GlmMoeDsaForCausalLM`` for
  GLM-5's class; ``DeepseekV32ForCausalLM`` inherits DeepSeek-V3's), ``n_routed_experts`` 256 (384
  only with Quark), ``n_shared_experts == 1``, ``moe_ep_size == 1``); fused, ``FusedMoE`` holds
  ``num_experts / ep + 1`` local slots, the shared expert after the routed ones
  (``_map_global_expert_id_to_local_expert_id``), loaded from ``mlp.shared_experts.*`` renamed to
  ``mlp.experts.{n_routed_experts}`` (``deepseek_weight_loader``), split by ``moe_tp_rank``.
* redundant experts and the other ``ServerArgs`` a layout cannot follow: refused, naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from weightsync.layout.sglang import engine_layout
from weightsync.layout.sglang_options import (
    check_server_args,
    layout_options,
    options_from_table,
    stale_router_warning,
)
from weightsync.models import get_model
from weightsync.models.checkpoint import hf_config_dict
from weightsync.models.config import spec_from_hf_config
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.engine_client import EngineClient
from weightsync.sync.engines import Engines, rollout_from_server_info


def _gate_dtype(spec: Any, par: RolloutParallel) -> str:
    layer = next(x for x in range(spec.num_layers) if spec.is_moe_layer(x))
    return {t.name: t.dtype for t in engine_layout(spec, par, 0)}[f"model.layers.{layer}.mlp.gate.weight"]


@pytest.mark.parametrize(("model", "router_fp32", "dtype"), [
    pytest.param("GLM-4.5-Air", False, "float32", id="glm4moe-gate-float32"),
    pytest.param("GLM-4.7-Flash", False, "float32", id="glm4moe-lite-gate-float32"),
    pytest.param("Kimi-K2", False, "bfloat16", id="moegate-model-dtype"),
    pytest.param("Kimi-K2", True, "float32", id="moegate-router-fp32"),
    pytest.param("GLM-5", True, "float32", id="glm5-moegate-router-fp32"),
    pytest.param("Qwen3-30B-A3B", True, "bfloat16", id="qwen3-moe-replicated-linear-gate"),
])
def test_router_dtype_follows_sglang_0_5_23(model: str, router_fp32: bool, dtype: str):
    spec = get_model(model, "tiny").replace(router_fp32=router_fp32)
    assert _gate_dtype(spec, RolloutParallel(tp=2)) == dtype
    # the given option wins over the rule: sglang 0.5.16's GLM gate, or a float32 one asked for
    assert _gate_dtype(spec, RolloutParallel(tp=2, router_fp32=False)) == "bfloat16"
    if spec.family.value != "qwen3_moe":
        assert _gate_dtype(spec, RolloutParallel(tp=2, router_fp32=True)) == "float32"


def _indexer(spec: Any, par: RolloutParallel) -> dict[str, Any]:
    ix = "model.layers.0.self_attn.indexer."
    return {t.name.removeprefix(ix): t for t in engine_layout(spec, par, 0) if t.name.startswith(ix)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dsa_indexer_fused_with_the_interleaved_rope(dtype: str):
    spec = get_model("GLM-5", "tiny").replace(dtype=dtype)  # indexer_rope_interleave: GLM-5's config
    dim, n, h = spec.index_head_dim, spec.index_n_heads, spec.hidden_size
    ix = "model.layers.0.self_attn.indexer."
    got = _indexer(spec, RolloutParallel(tp=2))
    assert list(got) == ["wq_b.weight", "wk_weights_proj.weight", "k_norm.weight", "k_norm.bias"]
    fused = got["wk_weights_proj.weight"]
    assert (fused.shape, fused.dtype) == ((dim + n, h), "bfloat16")
    assert [(p.global_name, p.global_box, p.local_box) for p in fused.pieces] == [
        (ix + "wk.weight", ((0, dim), (0, h)), ((0, dim), (0, h))),
        (ix + "weights_proj.weight", ((0, n), (0, h)), ((dim, dim + n), (0, h))),
    ]
    apart = _indexer(spec, RolloutParallel(tp=2, dsa_indexer_fusion=False))
    assert list(apart) == ["wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias"]
    assert (apart["wk.weight"].dtype, apart["weights_proj.weight"].dtype) == (dtype, "bfloat16")


def test_dsa_indexer_with_halves_rope_is_never_fused():
    spec = get_model("GLM-5", "tiny").replace(indexer_rope_interleave=False)  # DeepSeek-V3.2's indexer
    got = _indexer(spec, RolloutParallel(tp=2))
    assert {"wk.weight", "weights_proj.weight"} <= set(got)
    assert got["weights_proj.weight"].dtype == "bfloat16"
    with pytest.raises(ValueError, match="indexer_rope_interleave"):
        engine_layout(spec, RolloutParallel(tp=2, dsa_indexer_fusion=True), 0)


def test_reference_reads_the_indexer_weights_as_the_engine_stores_them():
    """A float32 run's logprob reference rounds what the engine holds in bfloat16, nothing else."""
    import torch

    from weightsync.launch.validate import as_engine_holds

    spec = get_model("GLM-5", "tiny").replace(dtype="float32")
    values = {n: torch.randn(2, 3, dtype=torch.float32) for n in ("w", "x")}
    ix = "model.layers.0.self_attn.indexer."
    read = {ix + "weights_proj.weight": values["w"], ix + "wq_b.weight": values["x"], ix + "wk.weight": values["x"]}
    for par, rounded in ((RolloutParallel(), {"weights_proj", "wk"}),
                         (RolloutParallel(dsa_indexer_fusion=False), {"weights_proj"})):
        held = as_engine_holds(spec, read.__getitem__, par)
        for name in ("weights_proj", "wk", "wq_b"):
            t = read[ix + name + ".weight"]
            want = t.to(torch.bfloat16).float() if name in rounded else t
            assert torch.equal(held(ix + name + ".weight"), want), (par, name)


@pytest.mark.parametrize(("model", "changes", "ep", "fused"), [
    pytest.param("GLM-4.5-Air", {}, 1, True, id="glm45-ep1"),
    pytest.param("GLM-4.5-Air", {}, 2, False, id="glm45-ep2"),
    pytest.param("GLM-4.7-Flash", {}, 1, True, id="glm47-ep1"),
    pytest.param("GLM-4.7-Flash", {"num_shared_experts": 2}, 1, False, id="glm47-two-shared"),
    pytest.param("GLM-5", {"num_experts": 256}, 1, True, id="glm5-256-ep1"),
    pytest.param("GLM-5", {"num_experts": 256}, 4, False, id="glm5-256-ep4"),
    pytest.param("GLM-5", {}, 1, False, id="glm5-tiny-8-experts"),
    pytest.param("GLM-5", {"num_experts": 256, "hf_architecture": "DeepseekV32ForCausalLM"}, 1, False,
                 id="deepseek-v32-architecture"),
    pytest.param("Kimi-K2", {"num_experts": 384}, 1, False, id="kimi-384-not-quark"),
    pytest.param("Kimi-K2", {"num_experts": 256}, 1, True, id="deepseek-v3-256"),
    pytest.param("Qwen3-30B-A3B", {}, 1, False, id="qwen3-moe-no-shared"),
])
def test_shared_experts_fusion_rule(model: str, changes: dict[str, Any], ep: int, fused: bool):
    spec = get_model(model, "tiny").replace(**changes)
    assert layout_options(spec, RolloutParallel(tp=4, ep=ep)).shared_experts_fusion is fused


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 3)])
def test_fused_shared_expert_is_the_last_expert_slot(tp: int, rank: int):
    """GLM-4.5-Air at ep 1: w13[E] = [shared gate rows; shared up rows] of this moe-TP rank, w2[E] its columns."""
    spec = get_model("GLM-4.5-Air", "tiny")  # 8 experts, one shared expert, moe ffn 32
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    i_l = i // tp
    rows = (rank * i_l, (rank + 1) * i_l)
    ts = {t.name: t for t in engine_layout(spec, RolloutParallel(tp=tp), rank)}
    m = "model.layers.1.mlp."
    assert not [n for n in ts if ".shared_experts." in n]
    w13, w2 = ts[m + "experts.w13_weight"], ts[m + "experts.w2_weight"]
    assert (w13.shape, w2.shape) == ((e + 1, 2 * i_l, h), (e + 1, h, i_l))
    slot = ((e, e + 1),)
    assert [(p.global_name, p.global_box, p.local_box) for p in w13.pieces if p.local_box[0] == slot[0]] == [
        (m + "shared_experts.gate_proj.weight", (rows, (0, h)), (*slot, (0, i_l), (0, h))),
        (m + "shared_experts.up_proj.weight", (rows, (0, h)), (*slot, (i_l, 2 * i_l), (0, h))),
    ]
    assert [(p.global_name, p.global_box) for p in w2.pieces if p.local_box[0] == slot[0]] == [
        (m + "shared_experts.down_proj.weight", ((0, h), rows))]
    apart = {t.name for t in engine_layout(spec, RolloutParallel(tp=tp, shared_experts_fusion=False), rank)}
    assert m + "shared_experts.gate_up_proj.weight" in apart


def test_shared_experts_fusion_under_expert_parallelism_is_refused():
    with pytest.raises(ValueError, match="expert parallelism"):
        engine_layout(get_model("GLM-4.5-Air", "tiny"), RolloutParallel(tp=2, ep=2, shared_experts_fusion=True), 0)


@pytest.mark.parametrize(("key", "value"), [
    ("ep_num_redundant_experts", 32), ("enable_eplb", True), ("moe_a2a_backend", "deepep"),
    ("init_expert_location", "/path/to/placement.json"), ("rl_on_policy_target", "fsdp"), ("dcp_size", 2),
])
def test_server_args_a_layout_cannot_follow_are_refused_naming_them(key: str, value: Any):
    info = {"tp_size": 8, "dp_size": 1, "ep_size": 8, "pp_size": 1, "moe_dense_tp_size": None,
            "enable_dp_lm_head": False}
    check_server_args(info)
    check_server_args({**info, "ep_num_redundant_experts": 0, "moe_a2a_backend": "none"})
    with pytest.raises(ValueError, match=f"{key}={value!r}") as err:
        rollout_from_server_info({**info, key: value}, num_engines=1)
    assert "\n" not in str(err.value)


def test_router_fp32_is_read_from_config_json():
    spec = get_model("GLM-5", "tiny").replace(router_fp32=True)
    cfg = hf_config_dict(spec)
    assert cfg["router_fp32"] is True
    assert spec_from_hf_config(cfg, name="GLM-5", scale="tiny").router_fp32
    cfg.pop("router_fp32")
    assert not spec_from_hf_config(cfg, name="GLM-5", scale="tiny").router_fp32


@pytest.mark.parametrize(("model", "par"), [
    pytest.param("GLM-4.5-Air", RolloutParallel(tp=2, router_fp32=False), id="glm-router-model-dtype"),
    pytest.param("GLM-4.7-Flash", RolloutParallel(tp=2), id="glm-lite-rule"),
    pytest.param("Kimi-K2", RolloutParallel(tp=2, ep=2, router_fp32=True), id="kimi-router-fp32"),
    pytest.param("Qwen3-30B-A3B", RolloutParallel(tp=2), id="qwen3-moe"),
    pytest.param("GLM-5", RolloutParallel(tp=2), id="glm5-indexer-fused"),
    pytest.param("GLM-5", RolloutParallel(tp=2, dsa_indexer_fusion=False), id="glm5-indexer-apart"),
    pytest.param("GLM-4.5-Air", RolloutParallel(tp=2), id="glm45-shared-fused"),
    pytest.param("GLM-4.5-Air", RolloutParallel(tp=2, shared_experts_fusion=False), id="glm45-shared-apart"),
    pytest.param("GLM-5", RolloutParallel(tp=2, shared_experts_fusion=True), id="glm5-shared-enforced"),
])
def test_options_are_read_back_from_a_published_table(model: str, par: RolloutParallel):
    """What an engine of ``par`` publishes (``{name: [ptr, numel, element_size]}``) gives back its options."""
    spec = get_model(model, "tiny")
    table = {t.name: [0, t.numel, {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}[t.dtype]]
             for t in engine_layout(spec, par, 1) if not t.derived}
    found = options_from_table(spec, RolloutParallel(tp=par.tp, ep=par.ep), table)
    assert layout_options(spec, found) == layout_options(spec, par)
    assert [t.dtype for t in engine_layout(spec, found, 1)] == [t.dtype for t in engine_layout(spec, par, 1)]


def test_stale_router_warning_only_for_a_glm_router_in_the_model_dtype():
    glm = get_model("GLM-4.5-Air", "tiny")
    warning = stale_router_warning(glm, RolloutParallel(tp=2, router_fp32=False), "0.5.16")
    assert warning is not None
    assert "0.5.16" in warning
    assert "ignored" in warning
    assert stale_router_warning(glm, RolloutParallel(tp=2), "0.5.23") is None
    assert stale_router_warning(get_model("Kimi-K2", "tiny"), RolloutParallel(tp=2), "0.5.16") is None


class _PublishingClient(EngineClient):
    """An engine that answers /server_info and one rank's table as sglang 0.5.16 would (no HTTP)."""

    def __init__(self, info: dict[str, Any], weights: dict[str, list[int]]) -> None:
        super().__init__("http://sglang.invalid:30000")
        self._info, self._weights = info, weights

    def server_info(self) -> dict[str, Any]:
        return self._info

    def transfer_engine_info(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "remote_instance_transfer_engine_info": ["host:1", self._weights]}


def test_discovery_reads_the_router_dtype_and_warns_about_sglang_0_5_16(caplog: pytest.LogCaptureFixture):
    spec = get_model("GLM-4.5-Air", "tiny")
    par = RolloutParallel(tp=2, router_fp32=False)
    table = {t.name: [0, t.numel, 4 if t.dtype == "float32" else 2] for t in engine_layout(spec, par, 0)
             if not t.derived}
    info = {"tp_size": 2, "dp_size": 1, "ep_size": 1, "pp_size": 1, "moe_dense_tp_size": None,
            "enable_dp_lm_head": False, "version": "0.5.16"}
    engines = Engines([_PublishingClient(info, table)])
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync.sync.engines"):
            found = engines.rollout_parallel(spec)
        assert found.router_fp32 is False
        assert any("0.5.16" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="weightsync.sync.engines"):
            assert engines.rollout_parallel(None).router_fp32 is None  # without a model: sizes only
        # this project's engine computes with the router it holds: no warning
        engines.clients[0]._info = {**info, "weightsync": {}}  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="weightsync.sync.engines"):
            assert engines.rollout_parallel(spec).router_fp32 is False
        assert not caplog.records
    finally:
        engines.close()
