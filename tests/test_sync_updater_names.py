"""Contract: a trainer rank's parameters are placed on its layout by name, shape and role, under the
names of either megatron-core layer spec; whatever cannot be placed is an error naming it.

The Transformer Engine spec's names (megatron-core 0.16 ``gpt_layer_specs.py``: ``linear_qkv`` and
a dense layer's ``linear_fc1`` fuse the preceding norm as ``layer_norm_weight``; MLA's up
projections fuse the q / kv layernorms; ``TEGroupedMLP`` registers ``weight{i}`` per local
expert; a MoE layer's ``pre_mlp_layernorm`` and MLA's ``input_layernorm`` stay separate ``TENorm``
modules) are written here from the local-spec layout, so every family's TE name set is covered.
"""

from __future__ import annotations

import re

import pytest
import torch

from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel
from weightsync.sync.names import layout_name, place_params


def te_name(name: str, *, mla: bool, moe_layer: bool) -> str:
    """The TE-spec name of a local-spec parameter."""
    m = re.match(r"^(decoder\.layers\.\d+)\.(.*)$", name)
    if m is None:
        return name
    layer, rest = m.groups()
    if rest == "input_layernorm.weight" and not mla:
        return f"{layer}.self_attention.linear_qkv.layer_norm_weight"
    if rest == "pre_mlp_layernorm.weight" and not moe_layer:
        return f"{layer}.mlp.linear_fc1.layer_norm_weight"
    if rest == "self_attention.q_layernorm.weight" and mla:
        return f"{layer}.self_attention.linear_q_up_proj.layer_norm_weight"
    if rest == "self_attention.kv_layernorm.weight" and mla:
        return f"{layer}.self_attention.linear_kv_up_proj.layer_norm_weight"
    e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest)
    if e:
        return f"{layer}.mlp.experts.linear_fc{e.group(2)}.weight{e.group(1)}"
    return name


def _params(spec, par, rank):
    return {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in trainer_layout(spec, par, rank)}


@pytest.mark.parametrize(("model", "par"), [
    pytest.param("Qwen3-4B", TrainParallel(world_size=2, tp=2), id="dense-tp2"),
    pytest.param("Qwen3-30B-A3B", TrainParallel(world_size=2, tp=1, ep=2), id="moe-ep2"),
    pytest.param("Kimi-K2", TrainParallel(world_size=2, tp=2, ep=2, etp=1, mla_down_proj_replicated=True),
                 id="mla-tp2"),
])
def test_te_spec_names_place_on_the_local_layout(model: str, par: TrainParallel):
    """Every TE-spec name (with a DDP ``module.`` prefix and TE's ``_extra_state`` entries, which
    are skipped) lands on the same layout tensor as its local-spec name: the same tensor object."""
    spec = get_model(model, "tiny")
    for rank in range(par.world_size):
        local = _params(spec, par, rank)
        te: dict[str, torch.Tensor] = {}
        renamed = 0
        for name, t in local.items():
            layer = re.match(r"^decoder\.layers\.(\d+)\.", name)
            moe_layer = bool(layer) and spec.is_moe_layer(int(layer.group(1)))  # PP 1: local index is global
            new = te_name(name, mla=spec.is_mla, moe_layer=moe_layer)
            renamed += new != name
            te["module." + new] = t
            te["module." + new.rsplit(".", 1)[0] + "._extra_state"] = torch.empty(0)
        assert renamed, "the TE names differ from the local ones"
        placed = place_params(te, spec, par, rank)
        assert list(placed) == list(local)
        assert all(placed[n].data_ptr() == local[n].data_ptr() for n in local)


def test_aliases():
    assert layout_name("module.module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert layout_name("decoder.layers.0.mlp.experts.linear_fc2.weight7") == \
        "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight"
    assert layout_name("decoder.layers.0.self_attention.linear_qkv._extra_state") is None


SPEC = get_model("Qwen3-4B", "tiny")
PAR = TrainParallel(world_size=2, tp=2)


@pytest.mark.parametrize(("change", "named"), [
    pytest.param(lambda p: p.update({"decoder.layers.0.mlp.linear_fc3.weight": torch.zeros(4)}),
                 "decoder.layers.0.mlp.linear_fc3.weight: no such tensor", id="unknown-name"),
    pytest.param(lambda p: p.pop("decoder.layers.1.self_attention.linear_proj.weight"),
                 "no parameter for 1 layout tensors, e.g. ['decoder.layers.1.self_attention.linear_proj.weight']",
                 id="missing"),
    pytest.param(lambda p: p.update({"decoder.final_layernorm.weight": torch.zeros(3, dtype=torch.bfloat16)}),
                 "decoder.final_layernorm.weight: shape [3]", id="shape"),
    pytest.param(lambda p: p.update({"decoder.final_layernorm.weight": torch.zeros(64)}),
                 "decoder.final_layernorm.weight: dtype torch.float32, the layout has bfloat16", id="dtype"),
    pytest.param(lambda p: p.update({"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight":
                                     p["decoder.layers.0.input_layernorm.weight"]}),
                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight (as decoder.layers.0.input_layernorm"
                 ".weight): also given as decoder.layers.0.input_layernorm.weight", id="two-names-one-tensor"),
])
def test_a_parameter_that_cannot_be_placed_is_named(change, named: str):
    params = _params(SPEC, PAR, 0)
    change(params)
    with pytest.raises(ValueError, match=re.escape(named)):
        place_params(params, SPEC, PAR, 0)


def test_a_partition_attribute_against_the_role_is_named():
    """A row-parallel weight marked as split along dim 0 (a column-parallel module in its place)."""
    params = _params(SPEC, PAR, 1)
    w = torch.nn.Parameter(params["decoder.layers.0.self_attention.linear_proj.weight"], requires_grad=False)
    w.tensor_model_parallel, w.partition_dim = True, 0
    params["decoder.layers.0.self_attention.linear_proj.weight"] = w
    with pytest.raises(ValueError, match=r"linear_proj.weight: partition_dim 0, the layout splits it along dim 1"):
        place_params(params, SPEC, PAR, 1)
    w.partition_dim = 1
    place_params(params, SPEC, PAR, 1)
