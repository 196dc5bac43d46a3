"""Contract: a checkpoint's ``config.json`` decides the model, every field that changes the forward
pass is honoured or refused with a message naming the field and its value, and both spellings
found in the wild (transformers 4.x and 5.x) read the same.

* The defaults a key absent from config.json takes are transformers' own (its config classes).
* transformers 5.x writes ``rope_parameters`` / ``num_local_experts`` / ``mlp_layer_types``; the same
  config in 4.x spelling (top-level ``rope_theta``, ``rope_scaling``, ``num_experts``,
  ``first_k_dense_replace``) gives the same spec.
* Every registry model's config.json (:func:`hf_config_dict`) reads back into its spec.
* A checkpoint of another family than the registry model's is refused naming both; unknown and
  unsupported fields are refused naming the field.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_helpers import FAMILIES
from weightsync.models import get_model, list_models
from weightsync.models.checkpoint import hf_config_dict
from weightsync.models.config import HF_DEFAULTS, ConfigError, spec_from_hf_config
from weightsync.models.resolve import model_spec

transformers = pytest.importorskip("transformers")


def _saved_config(key: str, tmp_path: Path) -> dict[str, Any]:
    """config.json as transformers 5.x's ``save_pretrained`` writes it for ``FAMILIES[key]``."""
    family = FAMILIES[key]
    cfg = getattr(transformers, family.config_class)(**family.config)
    cfg.architectures = [family.model_class]
    cfg.save_pretrained(str(tmp_path / key))
    return json.loads((tmp_path / key / "config.json").read_text())


def _as_4x(config: dict[str, Any]) -> dict[str, Any]:
    """The same config in transformers 4.x spelling."""
    old = copy.deepcopy(config)
    rope = old.pop("rope_parameters", {}) or {}
    old["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        old["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type", "default")
    rope.pop("type", None)
    old["rope_scaling"] = {"type": kind, **rope} if kind != "default" else None
    if "num_local_experts" in old:
        old["num_experts"] = old.pop("num_local_experts")
    types = old.pop("mlp_layer_types", None)
    if types is not None and old["architectures"][0] != "Glm4MoeLiteForCausalLM":
        old["first_k_dense_replace"] = types.index("sparse") if "sparse" in types else len(types)
    elif types is not None:
        old["mlp_layer_types"] = types  # GLM-4.7-Flash has no other spelling of its layer pattern
    return old


@pytest.mark.parametrize("key", list(FAMILIES))
def test_both_spellings_give_one_spec(key: str, tmp_path: Path):
    new = _saved_config(key, tmp_path)
    old = _as_4x(new)
    assert "rope_parameters" in new
    assert "rope_parameters" not in old
    family = FAMILIES[key]
    a = spec_from_hf_config(new, name=family.model, sources={})
    b = spec_from_hf_config(old, name=family.model, sources={})
    assert a == b
    if "rope_scaling" in family.config:
        assert a.rope_scaling is not None
        assert a.rope_scaling.factor == family.config["rope_scaling"]["factor"]
        assert a.rope_theta == family.config["rope_scaling"]["rope_theta"]
    else:
        assert a.rope_theta == family.config["rope_theta"]
    assert a.rms_norm_eps == family.config["rms_norm_eps"]


@pytest.mark.parametrize("arch", list(HF_DEFAULTS))
def test_defaults_are_transformers_defaults(arch: str):
    """A key absent from config.json reads transformers' default for the architecture."""
    cls = {f.model_class: f.config_class for f in FAMILIES.values()}[arch]
    cfg = getattr(transformers, cls)()
    rope = cfg.rope_parameters or {}
    for key, want in HF_DEFAULTS[arch].items():
        if key == "rope_theta":
            got = rope["rope_theta"]
        elif key == "partial_rotary_factor":
            got = rope.get("partial_rotary_factor", getattr(cfg, key, 1.0))
        elif want is None:  # "absent" in weightsync; transformers derives it (e.g. kv heads = heads)
            continue
        else:
            got = getattr(cfg, key)
        assert got == want, f"{arch}.{key}: transformers {got!r}, weightsync {want!r}"


@pytest.mark.parametrize("model", list_models())
@pytest.mark.parametrize("scale", ["full", "tiny"])
def test_registry_config_reads_back(model: str, scale: str):
    spec = get_model(model, scale)
    back = spec_from_hf_config(hf_config_dict(spec), name=spec.name, fp8_block=spec.fp8_block, scale=spec.scale,
                               sources=spec.sources)
    assert back == spec


def test_checkpoint_shapes_and_profile(tmp_path: Path):
    """The checkpoint's shapes, the profile's fp8 block; ``layers=N`` keeps the first N layers
    (and their MLP pattern)."""
    _saved_config("qwen3_moe", tmp_path)
    spec = model_spec("Qwen3-30B-A3B", "tiny", checkpoint=tmp_path / "qwen3_moe", dtype="float32")
    assert (spec.vocab_size, spec.hidden_size, spec.num_experts, spec.head_dim) == (130, 40, 6, 10)
    assert spec.mlp_layer_types == ("dense", "sparse", "dense", "sparse")  # decoder_sparse_step 2
    assert not spec.norm_topk_prob
    assert spec.dtype == "float32"
    assert spec.scale == "tiny"
    cut = model_spec("Qwen3-30B-A3B", "layers=2", checkpoint=tmp_path / "qwen3_moe")
    assert cut.num_layers == 2
    assert cut.mlp_layer_types == ("dense", "sparse")
    _saved_config("deepseek_v3", tmp_path)
    kimi = model_spec("Kimi-K2", "tiny", checkpoint=tmp_path / "deepseek_v3")
    assert kimi.fp8_block == (8, 8)
    assert kimi.q_lora_rank is None
    assert kimi.rope_scaling is not None


def test_another_family_is_refused_naming_both(tmp_path: Path):
    _saved_config("glm4_moe_lite", tmp_path)
    with pytest.raises(ConfigError) as err:
        model_spec("Kimi-K2", "tiny", checkpoint=tmp_path / "glm4_moe_lite")
    msg = str(err.value)
    assert "Glm4MoeLiteForCausalLM" in msg
    assert "Kimi-K2" in msg
    assert "DeepseekV3ForCausalLM" in msg
    _saved_config("deepseek_v32", tmp_path)  # GLM-5's profile serves the config the reference patches it to
    assert model_spec("GLM-5", "tiny", checkpoint=tmp_path / "deepseek_v32").hf_architecture == \
        "DeepseekV32ForCausalLM"


def _set(path: str, value: Any) -> Any:
    def edit(cfg: dict[str, Any]) -> None:
        node = cfg
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


REFUSED = [
    ("qwen3", _set("hidden_act", "gelu"), "hidden_act='gelu'"),
    ("qwen3", _set("use_sliding_window", True), "use_sliding_window=True"),
    ("qwen3", _set("attention_bias", True), "attention_bias=True"),
    ("qwen3", _set("rope_parameters.rope_type", "llama3"), "rope_type='llama3'"),
    ("qwen3", _set("rope_parameters.long_factor", [1.0]), "rope_parameters.long_factor"),
    ("qwen3", _set("attn_logit_softcapping", 30.0), "unknown key attn_logit_softcapping=30.0"),
    ("qwen3_moe", _set("n_shared_experts", 1), "n_shared_experts=1"),
    ("glm4_moe", _set("scoring_func", "softmax"), "scoring_func='softmax'"),
    ("glm4_moe_lite", _set("mlp_layer_types", ["dense", "sparse"]), "mlp_layer_types"),
    ("deepseek_v3", _set("moe_layer_freq", 2), "moe_layer_freq=2"),
    ("deepseek_v3", _set("scoring_func", "softmax"), "scoring_func='softmax'"),
    ("deepseek_v3", _set("topk_method", "sqrt_softplus"), "topk_method='sqrt_softplus'"),
    ("deepseek_v3", _set("partial_rotary_factor", 0.5), "partial_rotary_factor=0.5"),
    ("deepseek_v3", _set("quantization_config", {"quant_method": "compressed-tensors"}),
     "quantization_config.quant_method='compressed-tensors'"),
    ("deepseek_v3", _set("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                 "activation_scheme": "static"}),
     "quantization_config.activation_scheme='static'"),
    ("glm_moe_dsa", _set("indexer_types", ["full", "shared", "full"]), "indexer_types"),
    ("glm_moe_dsa", _set("rope_interleave", False), "rope_interleave=False"),
]


@pytest.mark.parametrize(("key", "edit", "named"), REFUSED,
                         ids=[f"{k}-{n.split('=')[0].split()[-1]}" for k, _, n in REFUSED])
def test_unsupported_field_is_refused_naming_it(key: str, edit: Any, named: str, tmp_path: Path):
    cfg = _saved_config(key, tmp_path)
    edit(cfg)
    with pytest.raises(ConfigError) as err:
        spec_from_hf_config(cfg, name=FAMILIES[key].model, where="x/config.json")
    msg = str(err.value)
    assert named in msg, msg
    assert msg.startswith("x/config.json: ")
    assert "\n" not in msg


def test_expert_tp_defaults_to_tp():
    """Megatron's default expert-TP size is the TP size; the reference profiles give ETP 1."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from weightsync.models import get_profile
    from weightsync.models.parallel import TrainParallel

    megatron = ModelParallelConfig(tensor_model_parallel_size=2).expert_tensor_parallel_size
    assert TrainParallel(world_size=4, tp=2, ep=2).etp == megatron == 2
    assert TrainParallel(world_size=2, tp=2, ep=2, etp=1).etp == 1
    assert {get_profile(m).train.etp for m in list_models()} == {1}


def test_unreadable_checkpoint_files_are_refused_naming_them(tmp_path: Path):
    from weightsync.sources.hf_source import check_hf_checkpoint

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{tmp_path}/config.json: not readable as JSON"):
        model_spec("Qwen3-4B", checkpoint=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(get_model("Qwen3-4B", "tiny"))))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    spec = model_spec("Qwen3-4B", "tiny", checkpoint=tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}/model.safetensors: not a readable safetensors file"):
        check_hf_checkpoint(tmp_path, spec)
