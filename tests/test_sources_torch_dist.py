"""The torch_dist checkpoint of weightsync's trainer: round trips, resharding and tiling.

Contracts:

* HF tensors -> ``write_torch_dist`` (all ranks of a parallel config, one process) -> every rank
  reads its shards -> gathered back equals the original tensors bit for bit, for every family at
  tiny scale and two parallel configurations (read back with the saving configuration and with a
  single rank, i.e. resharded).
* A rank of any configuration reads exactly the local tensors the trainer layout assembles from
  the HF tensors (vocab rows beyond the saved padding are zero).
* The stored chunks of every key tile its global shape exactly once (what DCP and Megatron's
  loader require); replicas are stored once.
* The directory is a released Megatron checkpoint: tracker, ``metadata.json``, ``common.pt``.
* MLA down projections duplicated over TP (``mla_down_proj_replicated``, the TE spec) are one
  chunk of the whole tensor, stored once; the stored tensors are the same as with the TP-split
  ones, so either setting reads a checkpoint written with the other.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from weightsync.layout.box import full_box
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model, list_models
from weightsync.models.checkpoint import synthetic_hf_tensors
from weightsync.models.parallel import TrainParallel
from weightsync.sources.dist_layout import dist_chunks, extra_state_objects, tp_split
from weightsync.sources.torch_dist import (
    BACKEND,
    assemble_box,
    read_global_tensors,
    read_rank_tensors,
    release_dir,
    stored_shapes,
    write_torch_dist,
)

FAMILY_MODELS = ["Qwen3-4B", "Qwen3-30B-A3B", "GLM-4.5-Air", "Kimi-K2", "GLM-4.7-Flash", "GLM-5"]
"""One registry model per family / variant (dense, MoE, GLM MoE, MLA+fp8, MLA, MLA+DSA)."""


def _configs(spec):
    if spec.is_moe:
        return [TrainParallel(world_size=4, tp=2, ep=2, etp=1), TrainParallel(world_size=8, tp=2, pp=2, ep=4, etp=1)]
    return [TrainParallel(world_size=2, tp=2), TrainParallel(world_size=8, tp=2, pp=2, cp=2)]


def _reader(hf):
    return lambda name, box: hf[name][tuple(slice(a, b) for a, b in box)]


@pytest.fixture(scope="module")
def tensors():
    return {m: synthetic_hf_tensors(get_model(m, "tiny"), seed=0) for m in FAMILY_MODELS}


@pytest.mark.parametrize("which", [0, 1], ids=["config-a", "config-b"])
@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_round_trip_bit_exact(model, which, tensors, tmp_path):
    spec = get_model(model, "tiny")
    par = _configs(spec)[which]
    hf = tensors[model]
    write_torch_dist(tmp_path, spec, par, _reader(hf))
    for reader_par in (par, TrainParallel(world_size=1)):
        back = read_global_tensors(tmp_path, spec, reader_par)
        trainer_names = [n for n in hf if not n.endswith("_scale_inv")]
        assert sorted(back) == sorted(trainer_names)
        for name in trainer_names:
            assert back[name].dtype == hf[name].dtype, name
            assert torch.equal(back[name], hf[name]), f"{name} differs after the round trip ({reader_par})"


@pytest.mark.parametrize("model", ["Qwen3-4B", "GLM-4.5-Air", "Kimi-K2"])
def test_any_config_reads_its_layout(model, tensors, tmp_path):
    """Saved at one configuration, read at another: each rank gets what the layout assembles."""
    spec = get_model(model, "tiny")
    hf = tensors[model]
    write_torch_dist(tmp_path, spec, _configs(spec)[1], _reader(hf))
    other = TrainParallel(world_size=4, tp=4, ep=4, etp=1) if spec.is_moe else TrainParallel(world_size=4, tp=4)
    for rank in range(other.world_size):
        got = read_rank_tensors(tmp_path, spec, other, rank)
        for lt in trainer_layout(spec, other, rank):
            want = assemble_box(lt, full_box(lt.shape), _reader(hf))
            assert torch.equal(got[lt.name], want), f"rank {rank} {lt.name}"


def test_vocab_beyond_saved_padding_is_zero(tensors, tmp_path):
    spec = get_model("Qwen3-4B", "tiny")  # vocab 300: tp 1 pads to 384, tp 4 to 512
    write_torch_dist(tmp_path, spec, TrainParallel(world_size=1), _reader(tensors["Qwen3-4B"]))
    assert stored_shapes(tmp_path)["embedding.word_embeddings.weight"] == (384, spec.hidden_size)
    last = read_rank_tensors(tmp_path, spec, TrainParallel(world_size=4, tp=4), 3)["embedding.word_embeddings.weight"]
    assert last.shape == (128, spec.hidden_size)
    assert not last.any()  # rows 384..511 were never saved, rows 300..383 are padding


@pytest.mark.parametrize("model", list_models())
def test_chunks_tile_every_key_once(model):
    """At the model's reference profile when it fits the tiny scale, else at TP 2 / EP 2 / PP 2."""
    from weightsync.sources.prepare import default_train

    spec = get_model(model, "tiny")
    par = default_train(spec)
    seen: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in range(par.world_size):
        for c in dist_chunks(spec, par, rank):
            key = (c.key, c.global_offset)
            assert seen.setdefault(key, c.chunk_shape) == c.chunk_shape, f"replicas of {key} differ in shape"
            assert shapes.setdefault(c.key, c.global_shape) == c.global_shape, c.key
    painted = {key: torch.zeros(shape, dtype=torch.int16) for key, shape in shapes.items()}
    for (key, offset), shape in seen.items():
        assert all(o + s <= g for o, s, g in zip(offset, shape, shapes[key], strict=True)), (key, offset)
        painted[key][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))] += 1
    for key, count in painted.items():
        assert int(count.min()) == 1, f"{key}: a region no chunk covers"
        assert int(count.max()) == 1, f"{key}: overlapping chunks"


MLA_MODELS = ["Kimi-K2", "GLM-4.7-Flash", "GLM-5"]


@pytest.mark.parametrize(("write_rep", "read_rep"), [(True, True), (True, False), (False, True)],
                         ids=["dup-dup", "dup-split", "split-dup"])
@pytest.mark.parametrize("model", MLA_MODELS)
def test_mla_down_proj_replicated_round_trip(model, write_rep, read_rep, tensors, tmp_path):
    """Written with one setting, read with either: each rank gets what its layout assembles."""
    spec = get_model(model, "tiny")
    par = TrainParallel(world_size=4, tp=2, ep=2, mla_down_proj_replicated=write_rep, etp=1)
    hf = tensors[model]
    write_torch_dist(tmp_path, spec, par, _reader(hf))
    reader = dataclasses.replace(par, mla_down_proj_replicated=read_rep)
    for rank in range(reader.world_size):
        got = read_rank_tensors(tmp_path, spec, reader, rank)
        for lt in trainer_layout(spec, reader, rank):
            assert torch.equal(got[lt.name], assemble_box(lt, full_box(lt.shape), _reader(hf))), (rank, lt.name)
    back = read_global_tensors(tmp_path, spec, reader)
    for name, t in back.items():
        assert torch.equal(t, hf[name]), name


@pytest.mark.parametrize("model", MLA_MODELS)
def test_mla_down_proj_replicated_is_one_chunk_stored_once(model, tensors, tmp_path):
    """Every TP (and DP) rank holds the same whole chunk (Megatron's replicas of a duplicated
    TELinear); the checkpoint stores it once, as one chunk per layer."""
    import torch.distributed.checkpoint as dcp

    spec = get_model(model, "tiny")
    par = TrainParallel(world_size=4, tp=2, ep=2, mla_down_proj_replicated=True, etp=1)
    down = [f"self_attention.{n}" for n in ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")]
    per_rank = [{(c.key, c.global_offset, c.chunk_shape) for c in dist_chunks(spec, par, r)
                 if c.local_name.endswith(tuple(down))} for r in range(par.world_size)]
    assert per_rank[0]
    assert all(chunks == per_rank[0] for chunks in per_rank)
    for r in range(par.world_size):
        for lt in trainer_layout(spec, par, r):
            if lt.name.endswith(tuple(down)):
                assert not tp_split(spec, lt.name, mla_down_proj_replicated=True).tensor_model_parallel
                assert tp_split(spec, lt.name).partition_dim == 0
    split = dataclasses.replace(par, mla_down_proj_replicated=False)
    assert extra_state_objects(spec, par, 1) == extra_state_objects(spec, split, 1)  # still linear modules
    write_torch_dist(tmp_path, spec, par, _reader(tensors[model]))
    md = dcp.FileSystemReader(release_dir(tmp_path)).read_metadata().state_dict_metadata
    keys = {key for key, _, _ in per_rank[0]}
    for key in keys:
        layers = len({off for k, off, _ in per_rank[0] if k == key})
        chunks = md[key].chunks
        assert len(chunks) == layers, key
        assert all(tuple(ch.sizes)[-2:] == tuple(md[key].size)[-2:] for ch in chunks), key


def test_release_directory_layout(tensors, tmp_path):
    spec = get_model("Qwen3-30B-A3B", "tiny")
    par = TrainParallel(world_size=4, tp=2, ep=2, etp=1)  # ranks 2, 3 are data-parallel replicas of 0, 1
    summary = write_torch_dist(tmp_path, spec, par, _reader(tensors["Qwen3-30B-A3B"]))
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    rel = release_dir(tmp_path)
    assert json.loads((rel / "metadata.json").read_text()) == BACKEND
    assert torch.load(rel / "common.pt")["iteration"] == 0
    # one file per rank that first holds some chunk (Megatron's __<rank>_<k>.distcp); replicas write none
    assert sorted(p.name for p in rel.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert summary.ranks == 4
    assert summary.objects > 0


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    spec = get_model("Qwen3-4B", "tiny")
    with pytest.raises(ValueError, match="not a Megatron checkpoint"):
        read_rank_tensors(tmp_path, spec, TrainParallel(world_size=1), 0)
