"""Contract of the trainer (Megatron-core) layout: its pieces tile the HF global tensors.

For every registry model at tiny scale and a grid of Megatron parallel configurations:

1. every global tensor (fp8 ``*_scale_inv`` excepted: the trainer holds none) is held
   somewhere, on exactly the PP stages that own it, and within one replica group -- ranks with
   the same (pp, cp, dp) for dense tensors, the same (pp, edp) for experts -- the pieces tile it
   exactly once (TP-split) or exactly ``tp`` times (replicated over TP);
2. the pieces of a local tensor tile it exactly once, except the vocab padding rows at its end;
3. shapes and dtypes agree with the global table;
4. data: random global tensors sharded through the pieces equal an independent oracle of
   Megatron's layout (fused QKV per query group, ``[gate_shard; up_shard]``, padded vocab, expert
   ranges), and reassemble to the originals.

The MLA families run the grid with both settings of ``mla_down_proj_replicated`` (the local
spec's TP-split down projections, the TE spec's duplicated ones).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from weightsync.layout.box import Box, LocalTensor, box_contains, box_volume, full_box
from weightsync.layout.megatron import (
    MLA_DOWN_PROJ,
    TrainCoords,
    check_trainer_config,
    stage_layers,
    train_coords,
    trainer_layout,
)
from weightsync.layout.megatron_pieces import padded_vocab_size
from weightsync.models import get_model, list_models
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import TrainParallel

MODELS = list_models()
MLA_MODELS = [m for m in MODELS if get_model(m, "tiny").is_mla]


def _par(world: int, **kw: int) -> TrainParallel:
    return TrainParallel(world_size=world, **{"etp": 1, **kw})  # ETP 1 unless given, as the profiles


CONFIGS = [
    pytest.param(_par(1), id="single"),
    pytest.param(_par(2, tp=2), id="tp2"),
    pytest.param(_par(4, tp=4), id="tp4-groups<tp"),
    pytest.param(_par(2, pp=2), id="pp2"),
    pytest.param(_par(4, tp=2, pp=2, pp_last_stage_layers=1), id="tp2-pp2-last1"),
    pytest.param(_par(4, tp=2, cp=2), id="tp2-cp2"),
    pytest.param(_par(4, tp=2, ep=2), id="tp2-ep2-dp2"),
    pytest.param(_par(8, tp=2, ep=4, etp=2), id="tp2-ep4-etp2-dp4"),
    pytest.param(_par(16, tp=4, pp=2, cp=2, ep=4), id="tp4-pp2-cp2-ep4-edp2"),
    pytest.param(_par(16, tp=2, pp=2, cp=2, ep=2, etp=2, pp_last_stage_layers=3), id="tp2-pp2-cp2-ep2-etp2-last3"),
    pytest.param(_par(8, tp=1, pp=2, ep=4, pp_last_stage_layers=1), id="tp1-pp2-ep4-last1-dp4"),
]


def _sl(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _all_layouts(spec, par, naming="sequential") -> dict[int, list[LocalTensor]]:
    return {r: trainer_layout(spec, par, r, expert_naming=naming) for r in range(par.world_size)}


def _stage_tensors(spec, par) -> list[set[str]]:
    """Names of the global tensors each PP stage must hold."""
    gts = global_tensors(spec)
    out = []
    for s, layers in enumerate(stage_layers(spec, par)):
        prefixes = tuple(f"model.layers.{i}." for i in layers)
        names = {n for n in gts if n.startswith(prefixes) and gts[n].quant_of is None}
        if s == 0:
            names.add("model.embed_tokens.weight")
        if s == par.pp - 1:
            names.add("model.norm.weight")
            names.add("model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight")
        out.append(names)
    return out


def _is_expert(global_name: str) -> bool:
    return ".mlp.experts." in global_name


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("par", CONFIGS)
def test_pieces_tile_global_tensors_per_replica_group(model, par):
    """Contract 1 (and 3 for global boxes): held on the right stages, tiled once per replica."""
    check_replica_tiling(get_model(model, "tiny"), par)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("par", CONFIGS)
def test_local_tensors_tiled_once_except_vocab_padding(model, par):
    """Contracts 2 and 3: local boxes tile the local tensor; only vocab padding rows are uncovered."""
    check_local_tiling(get_model(model, "tiny"), par)


def check_replica_tiling(spec, par) -> None:
    """Contract 1 for one (spec, par); shared with the property tests."""
    gts = global_tensors(spec)
    layouts = _all_layouts(spec, par)
    coords = {r: train_coords(par, r) for r in layouts}
    held: list[set[str]] = [set() for _ in range(par.pp)]
    groups: dict[tuple, dict[str, torch.Tensor]] = defaultdict(dict)
    full_holders: dict[tuple, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for r, tensors in layouts.items():
        c = coords[r]
        for t in tensors:
            for p in t.pieces:
                g = gts[p.global_name]
                assert g.quant_of is None, f"trainer holds fp8 scale {p.global_name}"
                assert box_contains(full_box(g.shape), p.global_box), (t.name, p)
                held[c.pp].add(p.global_name)
                key = ("expert", c.pp, c.edp) if _is_expert(p.global_name) else ("dense", c.pp, c.cp, c.dp)
                cnt = groups[key].setdefault(p.global_name, torch.zeros(g.shape, dtype=torch.int32))
                cnt[_sl(p.global_box)] += 1
                if p.global_box == full_box(g.shape):
                    full_holders[key][p.global_name].add(r)
    assert held == _stage_tensors(spec, par)
    expected_groups = {("dense", s, cp, dp) for s in range(par.pp) for cp in range(par.cp) for dp in range(par.dp)}
    moe_stages = [s for s, layers in enumerate(stage_layers(spec, par)) if any(map(spec.is_moe_layer, layers))]
    expected_groups |= {("expert", s, e) for s in moe_stages for e in range(par.edp)}
    assert set(groups) == expected_groups
    for key, counts in groups.items():
        stage_names = {n for n in _stage_tensors(spec, par)[key[1]] if _is_expert(n) == (key[0] == "expert")}
        assert set(counts) == stage_names, key
        for name, cnt in counts.items():
            times = len(full_holders[key][name]) or 1
            assert times in (1, par.tp), (key, name, times)
            assert torch.all(cnt == times), f"{key} {name}: coverage {cnt.unique().tolist()}, expected {times}"


def check_local_tiling(spec, par) -> None:
    """Contracts 2 and 3 for one (spec, par); shared with the property tests."""
    gts = global_tensors(spec)
    for r, tensors in _all_layouts(spec, par).items():
        c = train_coords(par, r)
        names = [t.name for t in tensors]
        assert len(names) == len(set(names)), f"rank {r}: duplicate names"
        for t in tensors:
            cnt = torch.zeros(t.shape, dtype=torch.int32)
            for p in t.pieces:
                assert box_contains(full_box(t.shape), p.local_box), (t.name, p)
                assert t.dtype == gts[p.global_name].dtype, (t.name, p.global_name)
                cnt[_sl(p.local_box)] += 1
            assert int(cnt.max()) <= 1, f"rank {r} {t.name}: overlapping pieces"
            if t.name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                per = padded_vocab_size(spec.vocab_size, par.tp, 128) // par.tp
                valid = max(0, min(per, spec.vocab_size - c.tp * per))
                assert t.shape == (per, spec.hidden_size)
                assert torch.all(cnt[:valid] == 1), (r, t.name)
                assert torch.all(cnt[valid:] == 0), (r, t.name)
            else:
                assert torch.all(cnt == 1), f"rank {r} {t.name}: uncovered elements"


# ---- data: an independent oracle of Megatron's layout, written with tensor ops ----


def _oracle(spec, par, rank, glob: dict[str, torch.Tensor], naming: str) -> dict[str, torch.Tensor]:
    """Megatron's local tensors of ``rank`` built the way HF->Megatron converters build them."""
    c = train_coords(par, rank)
    tp, r = par.tp, c.tp
    out: dict[str, torch.Tensor] = {}

    def vocab(t):
        padded = padded_vocab_size(spec.vocab_size, tp, 128)
        return torch.nn.functional.pad(t, (0, 0, 0, padded - t.shape[0])).chunk(tp)[r]

    def fc1(pre, rank_, parts):
        gate, up = glob[pre + "gate_proj.weight"], glob[pre + "up_proj.weight"]
        return torch.cat([gate.chunk(parts)[rank_], up.chunk(parts)[rank_]])

    def fc2(pre, rank_, parts):
        return glob[pre + "down_proj.weight"].chunk(parts, dim=1)[rank_]

    if c.pp == 0:
        out["embedding.word_embeddings.weight"] = vocab(glob["model.embed_tokens.weight"])
    for local, layer in enumerate(stage_layers(spec, par)[c.pp]):
        g, lp = f"model.layers.{layer}.", f"decoder.layers.{local}."
        a, la = g + "self_attn.", lp + "self_attention."
        out[lp + "input_layernorm.weight"] = glob[g + "input_layernorm.weight"]
        out[lp + "pre_mlp_layernorm.weight"] = glob[g + "post_attention_layernorm.weight"]
        out[la + "linear_proj.weight"] = glob[a + "o_proj.weight"].chunk(tp, dim=1)[r]
        if spec.is_mla:
            for mg, hf in (("linear_q_proj", "q_proj"), ("linear_q_down_proj", "q_a_proj"),
                           ("linear_q_up_proj", "q_b_proj"), ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                           ("linear_kv_up_proj", "kv_b_proj")):
                if a + hf + ".weight" not in glob:
                    continue
                whole = par.mla_down_proj_replicated and mg + ".weight" in MLA_DOWN_PROJ
                out[la + mg + ".weight"] = glob[a + hf + ".weight"] if whole else glob[a + hf + ".weight"].chunk(tp)[r]
            if spec.q_lora_rank is not None:
                out[la + "q_layernorm.weight"] = glob[a + "q_a_layernorm.weight"]
            out[la + "kv_layernorm.weight"] = glob[a + "kv_a_layernorm.weight"]
            for mg, hf in (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
                           ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
                           ("linear_weights_proj.weight", "weights_proj.weight")):
                if a + "indexer." + hf in glob:
                    out[la + "core_attention.indexer." + mg] = glob[a + "indexer." + hf]
        else:
            ng, d = spec.num_kv_heads, spec.head_dim
            for kind in ("weight", "bias"):
                if a + "q_proj." + kind not in glob:
                    continue
                q, k, v = (glob[a + x + "_proj." + kind] for x in "qkv")
                tail = q.shape[1:]
                fused = torch.cat([q.reshape(ng, -1, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1)
                out[la + "linear_qkv." + kind] = fused.reshape(-1, *tail).chunk(tp)[r]
            if spec.qk_norm:
                out[la + "q_layernorm.weight"] = glob[a + "q_norm.weight"]
                out[la + "k_layernorm.weight"] = glob[a + "k_norm.weight"]
        m, lm = g + "mlp.", lp + "mlp."
        if not spec.is_moe_layer(layer):
            out[lm + "linear_fc1.weight"] = fc1(m, r, tp)
            out[lm + "linear_fc2.weight"] = fc2(m, r, tp)
            continue
        out[lm + "router.weight"] = glob[m + "gate.weight"]
        if spec.router_expert_bias:
            out[lm + "router.expert_bias"] = glob[m + "gate.e_score_correction_bias"]
        per = spec.num_experts // par.ep
        for k in range(per):
            ex = f"{m}experts.{c.ep * per + k}."
            if naming == "sequential":
                names = [f"{lm}experts.local_experts.{k}.linear_fc{i}.weight" for i in (1, 2)]
            else:
                names = [f"{lm}experts.linear_fc{i}.weight{k}" for i in (1, 2)]
            out[names[0]] = fc1(ex, c.etp, par.etp)
            out[names[1]] = fc2(ex, c.etp, par.etp)
        if spec.num_shared_experts:
            out[lm + "shared_experts.linear_fc1.weight"] = fc1(m + "shared_experts.", r, tp)
            out[lm + "shared_experts.linear_fc2.weight"] = fc2(m + "shared_experts.", r, tp)
    if c.pp == par.pp - 1:
        out["decoder.final_layernorm.weight"] = glob["model.norm.weight"]
        if not spec.tie_word_embeddings:
            out["output_layer.weight"] = vocab(glob["lm_head.weight"])
        elif par.pp > 1:
            out["output_layer.weight"] = vocab(glob["model.embed_tokens.weight"])
    return out


@pytest.mark.parametrize("naming", ["sequential", "grouped"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("par", CONFIGS)
def test_data_round_trip_matches_oracle(model, par, naming):
    """Contract 4: shard random globals through the pieces == oracle; reassembly == originals."""
    check_data_round_trip(get_model(model, "tiny"), par, naming)


def check_data_round_trip(spec, par, naming="sequential") -> None:
    """Contract 4 for one (spec, par); shared with the property tests."""
    gen = torch.Generator().manual_seed(0)
    glob = {n: torch.randn(g.shape, generator=gen) for n, g in global_tensors(spec).items() if g.quant_of is None}
    recon = {n: torch.full_like(t, float("nan")) for n, t in glob.items()}
    for r, tensors in _all_layouts(spec, par, naming).items():
        oracle = _oracle(spec, par, r, glob, naming)
        assert {t.name for t in tensors} == set(oracle), f"rank {r}"
        for t in tensors:
            local = torch.zeros(t.shape)
            for p in t.pieces:
                local[_sl(p.local_box)] = glob[p.global_name][_sl(p.global_box)]
                recon[p.global_name][_sl(p.global_box)] = local[_sl(p.local_box)]
            assert torch.equal(local, oracle[t.name]), f"rank {r} {t.name}"
    for n, t in glob.items():
        assert torch.equal(recon[n], t), n


# ---- MLA down projections duplicated over TP (the TE spec) ----


def _replicated(par: TrainParallel) -> TrainParallel:
    return dataclasses.replace(par, mla_down_proj_replicated=True)


@pytest.mark.parametrize("model", MLA_MODELS)
@pytest.mark.parametrize("par", CONFIGS)
def test_mla_down_proj_replicated_contracts(model, par):
    """Contracts 1-4 with the down projections whole on every TP rank."""
    spec, par = get_model(model, "tiny"), _replicated(par)
    check_replica_tiling(spec, par)
    check_local_tiling(spec, par)
    check_data_round_trip(spec, par)


@pytest.mark.parametrize("model", MLA_MODELS)
@pytest.mark.parametrize("replicated", [False, True])
def test_mla_down_proj_pieces(model, replicated):
    """TP 2: the down projections are row halves (local spec) or the whole tensor (TE spec) on each
    TP rank; every other tensor is the same either way."""
    spec = get_model(model, "tiny")
    par = _par(2, tp=2, mla_down_proj_replicated=replicated)
    plain = _par(2, tp=2)
    gts = global_tensors(spec)
    for r in range(2):
        got = {t.name: t for t in trainer_layout(spec, par, r)}
        base = {t.name: t for t in trainer_layout(spec, plain, r)}
        assert list(got) == list(base)
        for name, t in got.items():
            if name.rsplit("self_attention.", 1)[-1] not in MLA_DOWN_PROJ:
                assert t == base[name], name
                continue
            (piece,) = t.pieces
            shape = gts[piece.global_name].shape
            if replicated:
                assert t.shape == shape, name
                assert piece.global_box == full_box(shape), name
            else:
                half = shape[0] // 2
                assert piece.global_box == ((r * half, (r + 1) * half), (0, shape[1])), name


def test_mla_down_proj_replicated_lifts_the_row_constraint():
    """Down projection rows that TP does not divide are fine when the projections are whole."""
    spec = get_model("Kimi-K2", "tiny").replace(kv_lora_rank=30)
    with pytest.raises(ValueError, match="mla_down_proj_replicated"):
        check_trainer_config(spec, _par(4, tp=4))
    check_trainer_config(spec, _par(4, tp=4, mla_down_proj_replicated=True))
    kv = [t for t in trainer_layout(spec, _par(4, tp=4, mla_down_proj_replicated=True), 3)
          if t.name.endswith("linear_kv_down_proj.weight")]
    assert kv
    assert all(t.shape == (30 + spec.qk_rope_head_dim, spec.hidden_size) for t in kv)


def test_mla_down_proj_replicated_is_a_no_op_without_mla():
    spec = get_model("Qwen3-30B-A3B", "tiny")
    for r in range(4):
        assert trainer_layout(spec, _par(4, tp=2, ep=2), r) == \
            trainer_layout(spec, _par(4, tp=2, ep=2, mla_down_proj_replicated=True), r)


def test_kimi_k2_reference_profile_keeps_fp8_blocks_whole():
    """Kimi-K2's profile (TP 8): kv_a_proj_with_mqa (576 rows) split over TP 8 would be 72-row
    shards that cut [64, 64] fp8 blocks; the profile's duplicated down projections hold it whole."""
    from weightsync.models import get_profile

    spec, par = get_model("Kimi-K2"), get_profile("Kimi-K2").train
    assert par.mla_down_proj_replicated
    assert par.tp == 8
    block = spec.fp8_block
    assert block is not None
    gts = global_tensors(spec)
    for rank in (0, 7):
        down = [p for t in trainer_layout(spec, par, rank) if t.name.endswith(MLA_DOWN_PROJ) for p in t.pieces]
        assert len(down) == 2 * 8  # both projections of the stage's 8 layers
        for p in down:
            assert p.global_box == full_box(gts[p.global_name].shape), p.global_name
    split = trainer_layout(spec, dataclasses.replace(par, mla_down_proj_replicated=False), 1)
    (kv,) = [t for t in split if t.name == "decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    assert kv.pieces[0].global_box[0] == (72, 144)
    assert 72 % block[0]


# ---- rank coordinates, stages, names, errors ----


_c = TrainCoords


@pytest.mark.parametrize(
    ("par", "rank", "expected"),
    [
        pytest.param(_par(16, tp=2, cp=2, pp=2, ep=4), 13, _c(tp=1, cp=0, dp=1, pp=1, ep=1, etp=0, edp=1), id="r13"),
        pytest.param(_par(16, tp=2, cp=2, pp=2, ep=4), 6, _c(tp=0, cp=1, dp=1, pp=0, ep=2, etp=0, edp=1), id="r6"),
        pytest.param(_par(8, tp=2, ep=2, etp=2), 5, _c(tp=1, cp=0, dp=2, pp=0, ep=0, etp=1, edp=1), id="etp2"),
        pytest.param(_par(256, tp=8, pp=8, cp=4, ep=32), 255, _c(tp=7, cp=3, dp=0, pp=7, ep=31, etp=0, edp=0),
                     id="kimi-last"),
        pytest.param(_par(256, tp=8, pp=8, cp=4, ep=32), 40, _c(tp=0, cp=1, dp=0, pp=1, ep=8, etp=0, edp=0),
                     id="kimi-40"),
    ],
)
def test_train_coords_table(par, rank, expected):
    assert train_coords(par, rank) == expected


@pytest.mark.parametrize(
    ("layers", "pp", "last", "expected"),
    [
        pytest.param(4, 1, None, [(0, 4)], id="pp1"),
        pytest.param(4, 2, None, [(0, 2), (2, 4)], id="even"),
        pytest.param(4, 2, 1, [(0, 3), (3, 4)], id="last1"),
        pytest.param(61, 8, 5, [(8 * s, 8 * s + 8) for s in range(7)] + [(56, 61)], id="kimi"),
        pytest.param(46, 4, 10, [(0, 12), (12, 24), (24, 36), (36, 46)], id="glm45air"),
        pytest.param(20, 3, 6, [(0, 7), (7, 14), (14, 20)], id="glm5-20"),
    ],
)
def test_stage_layers_table(layers, pp, last, expected):
    spec = get_model("Qwen3-4B", "tiny").replace(num_layers=layers)
    got = stage_layers(spec, _par(pp, pp=pp, pp_last_stage_layers=last))
    assert [(r.start, r.stop) for r in got] == expected


@pytest.mark.parametrize(
    ("layers", "pp", "last", "match"),
    [
        pytest.param(5, 2, None, "not divisible by pp=2", id="uneven-no-last"),
        pytest.param(6, 3, 1, "not divisible by the other pp-1=2", id="middle-uneven"),
        pytest.param(4, 2, 0, "must be > 0", id="last0"),
        pytest.param(4, 2, 4, "at least one layer", id="last-all"),
        pytest.param(4, 1, 3, "at least one layer", id="pp1-last-short"),
    ],
)
def test_stage_layers_refuses(layers, pp, last, match):
    spec = get_model("Qwen3-4B", "tiny").replace(num_layers=layers)
    with pytest.raises(ValueError, match=match):
        stage_layers(spec, _par(pp, pp=pp, pp_last_stage_layers=last))


@pytest.mark.parametrize(
    ("model", "changes", "par", "match"),
    [
        pytest.param("Qwen3-4B", {}, _par(8, tp=8), "num_attention_heads=4 is not divisible by tp=8", id="heads"),
        pytest.param("Qwen3-4B", {"num_attention_heads": 6, "num_kv_heads": 3}, _par(2, tp=2),
                     "multiple or a divisor", id="groups"),
        pytest.param("Qwen3-30B-A3B", {}, _par(16, ep=16), "num_experts=8 is not divisible by ep=16", id="experts"),
        pytest.param("Qwen3-30B-A3B", {}, _par(64, etp=64), "moe_intermediate_size=32 is not divisible by etp=64",
                     id="etp"),
        pytest.param("Kimi-K2", {"kv_lora_rank": 30}, _par(4, tp=4), "linear_kv_down_proj", id="mla-kv-down"),
        pytest.param("Qwen3-4B", {"intermediate_size": 130}, _par(4, tp=4), "intermediate_size=130", id="ffn"),
        pytest.param("Qwen3-4B", {"num_attention_heads": 4, "num_kv_heads": 1, "head_dim": 5}, _par(4, tp=4),
                     "linear_qkv rows=30 is not divisible by tp=4", id="qkv-rows"),
    ],
)
def test_config_refused_with_constraint(model, changes, par, match):
    spec = get_model(model, "tiny").replace(**changes)
    with pytest.raises(ValueError, match=match):
        check_trainer_config(spec, par)
    with pytest.raises(ValueError, match=match):
        trainer_layout(spec, par, 0)


def test_bad_rank_and_naming_refused():
    spec = get_model("Qwen3-4B", "tiny")
    with pytest.raises(ValueError, match="outside"):
        trainer_layout(spec, _par(2, tp=2), 2)
    with pytest.raises(ValueError, match="expert_naming"):
        trainer_layout(spec, _par(1), 0, expert_naming="legacy")


def test_names_qwen3_moe_tp2_ep2_sequential():
    """The exact parameter names (named_parameters order) of one rank of a tiny Qwen3-MoE."""
    spec = get_model("Qwen3-30B-A3B", "tiny").replace(num_layers=2)
    names = [t.name for t in trainer_layout(spec, _par(8, tp=2, pp=2, ep=4), 7)]
    layer = "decoder.layers.0."
    assert names == [
        layer + "input_layernorm.weight",
        layer + "self_attention.linear_proj.weight",
        layer + "self_attention.linear_qkv.weight",
        layer + "self_attention.q_layernorm.weight",
        layer + "self_attention.k_layernorm.weight",
        layer + "pre_mlp_layernorm.weight",
        layer + "mlp.router.weight",
        layer + "mlp.experts.local_experts.0.linear_fc1.weight",
        layer + "mlp.experts.local_experts.0.linear_fc2.weight",
        layer + "mlp.experts.local_experts.1.linear_fc1.weight",
        layer + "mlp.experts.local_experts.1.linear_fc2.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]


@pytest.mark.parametrize(("pp", "has_output"), [(1, False), (2, True)])
def test_tied_embeddings_output_layer(pp, has_output):
    """Tied: pp=1 has no output_layer.weight; pp>1 keeps a copy of the embedding on the last stage."""
    spec = get_model("Qwen3-4B", "tiny")
    assert spec.tie_word_embeddings
    last = trainer_layout(spec, _par(pp, pp=pp), pp - 1)
    out = [t for t in last if t.name == "output_layer.weight"]
    assert bool(out) == has_output
    if out:
        assert {p.global_name for p in out[0].pieces} == {"model.embed_tokens.weight"}


def test_full_size_reference_profiles_cover_every_tensor():
    """Every registry model at full size on its reference profile: piece volumes per replica
    group add up to each global tensor's size (metadata only)."""
    from weightsync.models import get_profile

    for model in MODELS:
        spec, par = get_model(model), get_profile(model).train
        gts = global_tensors(spec)
        volume: dict[str, int] = defaultdict(int)
        for r in range(par.world_size):
            c = train_coords(par, r)
            if (c.cp, c.dp) != (0, 0) and c.edp != 0:
                continue
            for t in trainer_layout(spec, par, r):
                for p in t.pieces:
                    if _is_expert(p.global_name):
                        counted = c.edp == 0
                    else:  # one (cp, dp) replica; a TP-replicated tensor from TP rank 0 only
                        replicated = p.global_box == full_box(gts[p.global_name].shape)
                        counted = (c.cp, c.dp) == (0, 0) and (c.tp == 0 or not replicated)
                    if counted:
                        volume[p.global_name] += box_volume(p.global_box)
        tied_copy = spec.tie_word_embeddings and par.pp > 1
        for name, g in gts.items():
            if g.quant_of is not None:
                continue
            want = g.numel * (2 if tied_copy and name == "model.embed_tokens.weight" else 1)
            assert volume[name] == want, (model, name, volume[name], want)
