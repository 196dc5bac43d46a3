"""``weightsync prepare``: outputs, idempotence, and refusal of bad input.

Contracts:

* Without ``--hf-checkpoint`` it writes a synthetic HF checkpoint (and says so), the torch_dist
  shards of the requested parallel configuration, and the prompt file, under the checkpoint
  directory, with the documented names (``MODEL_tiny``, ``MODEL_<N>layer``).
* A second run with the same request skips every step; an interrupted run (a temporary
  directory left behind) is cleaned up and redone; another request replaces weightsync's own
  output, never a directory weightsync did not write.
* A checkpoint of another family than the model's, one whose tensors do not match its own
  config.json (missing or mis-shaped ones), or a parallel configuration that does not divide, is
  refused with a message naming the problem, and nothing is left in the checkpoint directory.
* A copy of a real checkpoint is what a later ``prepare`` (and ``run``) of the same directory uses,
  never synthetic weights; outside the tiny scale synthetic weights are written only on request.
* The CLI reads ``CKPT_SAVE_DIR`` through the launcher's environment reader.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightsync.cli import prepare as prepare_cli
from weightsync.models import get_model
from weightsync.models.checkpoint import hf_config_dict, read_hf_checkpoint, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.parallel import TrainParallel
from weightsync.sources import prepare as prep
from weightsync.sources.torch_dist import read_global_tensors

MODEL = "Qwen3-30B-A3B"
TRAIN = TrainParallel(world_size=2, tp=2, ep=2, etp=1)


def _cfg(tmp_path, **kw):
    kw.setdefault("train", TRAIN)
    return prep.PrepareConfig(model=MODEL, scale="tiny", ckpt_dir=tmp_path / "ckpt", progress=False, **kw)


def _real_checkpoint(path, model=MODEL, seed=7):
    spec = get_model(model, "tiny")
    tensors = synthetic_hf_tensors(spec, seed)
    write_hf_checkpoint(path, tensors, hf_config_dict(spec))
    return tensors


def _listing(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.mark.parametrize(("scale", "name"), [("full", "M"), ("tiny", "M_tiny"), ("layers=4", "M_4layer")])
def test_output_names(scale, name):
    assert prep.output_name("M", scale) == name


@pytest.mark.parametrize(("given", "scale", "name"), [
    pytest.param("/models/my-qwen", "tiny", "my-qwen", id="tiny"),
    pytest.param("/models/my-qwen/", "full", "my-qwen", id="full-trailing-slash"),
    pytest.param("/models/my-qwen", "layers=2", "my-qwen_2layer", id="layers"),
    pytest.param("/x/datasets", "tiny", "datasets_checkpoint", id="not-the-prompts-folder"),
])
def test_a_given_checkpoint_is_named_by_its_directory(given, scale, name):
    assert prep.given_name(given, scale) == name


def test_given_checkpoint_output_is_its_own_and_stays_the_models_until_another_is_given(tmp_path):
    """``prepare --hf-checkpoint DIR`` writes ``<ckpt>/<DIR's name>`` (never ``MODEL_tiny``), and a
    later ``prepare`` (or ``run``) of the model without one uses that copy again, even where a
    synthetic ``MODEL_tiny`` was there first; a newer given checkpoint takes its place."""
    synthetic = prep.prepare(_cfg(tmp_path), say=lambda s: None)
    assert synthetic.synthetic
    src = tmp_path / "my-qwen-moe"
    tensors = _real_checkpoint(src, seed=5)
    given = prep.prepare(_cfg(tmp_path, hf_checkpoint=src), say=lambda s: None)
    assert (given.paths.hf.name, given.paths.torch_dist.name) == ("my-qwen-moe", "my-qwen-moe_torch_dist")
    again = prep.prepare(_cfg(tmp_path), say=lambda s: None)
    assert again.paths.hf == given.paths.hf
    assert not again.synthetic
    assert again.actions["hf"] == "skipped (recorded)"
    hf, torch_dist = prep.ensure_prepared(MODEL, scale="tiny", ckpt_dir=tmp_path / "ckpt", train=TRAIN, progress=False)
    assert (hf, torch_dist) == (given.paths.hf, given.paths.torch_dist)
    back = read_global_tensors(torch_dist, get_model(MODEL, "tiny"), TRAIN)
    assert torch.equal(back["model.norm.weight"], tensors["model.norm.weight"])
    other = tmp_path / "other-moe"
    _real_checkpoint(other, seed=6)
    prep.prepare(_cfg(tmp_path, hf_checkpoint=other), say=lambda s: None)
    assert prep.ensure_prepared(MODEL, scale="tiny", ckpt_dir=tmp_path / "ckpt", train=TRAIN,
                                progress=False)[0].name == "other-moe"
    assert f"{MODEL}_tiny" in _listing(tmp_path / "ckpt"), "the synthetic output is kept, not overwritten"


def test_describe_model_names_a_checkpoint_by_itself(tmp_path):
    from weightsync.models.resolve import describe_model, model_spec

    assert describe_model(get_model(MODEL, "tiny")) == \
        f"{MODEL} at tiny scale (4 layers, hidden 64, 4 heads, vocab 300, 8 experts)"
    src = tmp_path / "my-qwen-moe"
    _real_checkpoint(src)
    spec = model_spec(MODEL, "layers=2", checkpoint=src)
    assert describe_model(spec, src) == (f"checkpoint my-qwen-moe (Qwen3MoeForCausalLM: 2 layers, hidden 64, 4 heads, "
                                         f"vocab 300, 8 experts; its first 2 layers), run profile {MODEL}")


def test_mla_embedded_default_shards_keep_down_projections_whole(tmp_path):
    """Kimi-K2's embedded default (train TP 2, duplicated MLA down projections): prepare writes its
    shards, and each rank reads the whole down projections back."""
    from weightsync.models.fit import embedded_layout
    from weightsync.sources.torch_dist import read_rank_tensors

    train, _ = embedded_layout("Kimi-K2")
    assert train.tp == 2
    assert train.mla_down_proj_replicated
    cfg = prep.PrepareConfig(model="Kimi-K2", scale="tiny", ckpt_dir=tmp_path, progress=False, train=train)
    result = prep.prepare(cfg, say=lambda s: None)
    assert result.train == train
    assert result.actions["torch_dist"] == "written"
    spec = get_model("Kimi-K2", "tiny")
    hf, _ = read_hf_checkpoint(result.paths.hf)
    for rank in range(train.world_size):
        got = read_rank_tensors(result.paths.torch_dist, spec, train, rank)
        kv = got["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
        assert torch.equal(kv, hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    # the other setting is another request: the shards are redone
    split = prep.prepare(prep.PrepareConfig(model="Kimi-K2", scale="tiny", ckpt_dir=tmp_path, progress=False,
                                            train=TrainParallel(world_size=2, tp=2, ep=2, etp=1)), say=lambda s: None)
    assert split.actions["torch_dist"] == "written"


def test_synthetic_prepare_then_skip(tmp_path):
    lines: list[str] = []
    first = prep.prepare(_cfg(tmp_path), say=lines.append)
    paths = first.paths
    assert first.synthetic
    assert first.actions == {"hf": "written", "torch_dist": "written", "prompts": "written"}
    assert any("SYNTHETIC" in line for line in lines)
    assert paths.hf.name == f"{MODEL}_tiny"
    assert paths.torch_dist.name == f"{MODEL}_tiny_torch_dist"
    tensors, config = read_hf_checkpoint(paths.hf)
    assert config == hf_config_dict(get_model(MODEL, "tiny"))
    back = read_global_tensors(paths.torch_dist, get_model(MODEL, "tiny"), TRAIN)
    assert all(torch.equal(back[n], tensors[n]) for n in back)
    assert len(first.prompts.read_text().splitlines()) == 64
    second = prep.prepare(_cfg(tmp_path), say=lines.append)
    assert second.actions == {"hf": "skipped (complete)", "torch_dist": "skipped (complete)",
                              "prompts": "skipped (complete)"}
    # another parallel configuration: the torch_dist output is redone, the HF one kept
    third = prep.prepare(_cfg(tmp_path, train=TrainParallel(world_size=1)), say=lines.append)
    assert third.actions["hf"] == "skipped (complete)"
    assert third.actions["torch_dist"] == "written"
    assert not [n for n in _listing(paths.root) if ".tmp-" in n]


def test_interrupted_output_is_redone(tmp_path):
    paths = prep.checkpoint_paths(tmp_path / "ckpt", MODEL, "tiny")
    stale = paths.root / f".{paths.torch_dist.name}.tmp-99-dead"
    stale.mkdir(parents=True)
    (stale / "half.distcp").write_bytes(b"x")
    result = prep.prepare(_cfg(tmp_path), say=lambda s: None)
    assert result.actions["torch_dist"] == "written"
    assert not stale.exists()


def test_given_hf_checkpoint_is_copied_not_synthetic(tmp_path):
    src = tmp_path / "downloaded"
    tensors = _real_checkpoint(src)
    result = prep.prepare(_cfg(tmp_path, hf_checkpoint=src), say=lambda s: None)
    assert not result.synthetic
    copied, _ = read_hf_checkpoint(result.paths.hf)
    assert all(torch.equal(copied[n], tensors[n]) for n in tensors)
    assert (src / "config.json").is_file()  # the source is untouched


def test_recorded_checkpoint_is_reused_not_replaced_by_synthetic(tmp_path):
    src = tmp_path / "downloaded"
    tensors = _real_checkpoint(src, seed=11)
    first = prep.prepare(_cfg(tmp_path, hf_checkpoint=src), say=lambda s: None)
    assert first.weights == f"checkpoint:{src.resolve()}"
    assert first.paths.hf.name == "downloaded"
    again = prep.prepare(_cfg(tmp_path), say=lambda s: None)  # no --hf-checkpoint: what prepare recorded
    assert not again.synthetic
    assert again.actions == {"hf": "skipped (recorded)", "torch_dist": "skipped (complete)",
                             "prompts": "skipped (complete)"}
    assert prep.weights_label(again.paths.hf) == first.weights
    hf, _ = prep.ensure_prepared(MODEL, scale="tiny", ckpt_dir=tmp_path / "ckpt", train=TRAIN, progress=False)
    copied, _ = read_hf_checkpoint(hf)
    assert torch.equal(copied["model.norm.weight"], tensors["model.norm.weight"])


def test_no_synthetic_weights_beyond_tiny_unless_asked(tmp_path):
    """A run (no download) of a full-size model with nothing prepared stops and says how to get a
    checkpoint; synthetic weights there only with ``synthetic=True`` (here refused as too large)."""
    with pytest.raises(ValueError, match=r"no checkpoint of Kimi-K2 .*weightsync prepare Kimi-K2 --scale full.*"
                                         r"moonshotai/Kimi-K2-Instruct.*--synthetic"):
        prep.ensure_prepared("Kimi-K2", scale="full", ckpt_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"would be .* GiB"):
        prep.ensure_prepared("Kimi-K2", scale="full", ckpt_dir=tmp_path, progress=False, synthetic=True)
    assert _listing(tmp_path) == []


def test_hf_checkpoint_already_in_place_is_used(tmp_path):
    paths = prep.checkpoint_paths(tmp_path / "ckpt", MODEL, "tiny")
    tensors = _real_checkpoint(paths.hf)  # e.g. downloaded there: no weightsync marker
    result = prep.prepare(_cfg(tmp_path), say=lambda s: None)
    assert result.actions["hf"] == "used in place"
    assert not result.synthetic
    back = read_global_tensors(paths.torch_dist, get_model(MODEL, "tiny"), TRAIN)
    assert torch.equal(back["model.norm.weight"], tensors["model.norm.weight"])


def _bad_config(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = 96
    (src / "config.json").write_text(json.dumps(cfg))


def _missing_tensor(src):
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, src / "model.safetensors")


def _wrong_shape(src):
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)
    save_file(tensors, src / "model.safetensors")


@pytest.mark.parametrize(("damage", "message"), [
    (_bad_config, r"model.embed_tokens.weight \[300, 64\] \(expected \[300, 96\]\)"),
    (_missing_tensor, "missing tensors: model.layers.1.mlp.experts.3.up_proj.weight"),
    (_wrong_shape, r"model.layers.0.self_attn.o_proj.weight \[64, 32\] \(expected \[64, 64\]\)"),
], ids=["config", "missing", "shape"])
def test_bad_checkpoint_refused_nothing_written(tmp_path, damage, message):
    src = tmp_path / "downloaded"
    _real_checkpoint(src)
    damage(src)
    with pytest.raises(ValueError, match=message):
        prep.prepare(_cfg(tmp_path, hf_checkpoint=src), say=lambda s: None)
    assert _listing(tmp_path / "ckpt") == []


def test_other_model_refused(tmp_path):
    src = tmp_path / "downloaded"
    _real_checkpoint(src, model="Qwen3-4B")
    with pytest.raises(ValueError, match=r"is a Qwen3ForCausalLM .*Qwen3-30B-A3B serves Qwen3MoeForCausalLM"):
        prep.prepare(_cfg(tmp_path, hf_checkpoint=src), say=lambda s: None)
    assert _listing(tmp_path / "ckpt") == []


@pytest.mark.parametrize(("train", "message"), [
    (TrainParallel(world_size=3, tp=3), "num_attention_heads=4 is not divisible by tp=3"),
    (TrainParallel(world_size=3, ep=3), "num_experts=8 is not divisible by ep=3"),
    (TrainParallel(world_size=3, pp=3), "num_layers=4 is not divisible by pp=3"),
], ids=["tp", "ep", "pp"])
def test_parallel_config_that_does_not_divide(tmp_path, train, message):
    with pytest.raises(ValueError, match=message):
        prep.prepare(_cfg(tmp_path, train=train), say=lambda s: None)
    assert _listing(tmp_path / "ckpt") == []


def test_foreign_directory_is_never_replaced(tmp_path):
    paths = prep.checkpoint_paths(tmp_path / "ckpt", MODEL, "tiny")
    paths.hf.mkdir(parents=True)
    (paths.hf / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="was not written by weightsync"):
        prep.prepare(_cfg(tmp_path), say=lambda s: None)
    assert (paths.hf / "notes.txt").read_text() == "mine"


def test_synthetic_full_scale_too_large_is_refused(tmp_path):
    cfg = prep.PrepareConfig(model="Kimi-K2", scale="full", ckpt_dir=tmp_path, progress=False, download_only=True,
                             synthetic=True)
    with pytest.raises(ValueError, match=r"would be .* GiB"):
        prep.prepare(cfg, say=lambda s: None)


def test_cli_uses_ckpt_save_dir_and_reports_errors(tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    prepare_cli.add_arguments(parser)
    monkeypatch.setenv("CKPT_SAVE_DIR", str(tmp_path / "env"))
    rc = prepare_cli.main(parser.parse_args([MODEL, "--scale", "tiny", "--train", "tp=2,ep=2,world=2", "--no-progress",
                                      "--download-only"]))
    assert rc == 0
    assert (tmp_path / "env" / f"{MODEL}_tiny" / "config.json").is_file()
    assert not (tmp_path / "env" / f"{MODEL}_tiny_torch_dist").exists()  # --download-only
    assert "SYNTHETIC" in capsys.readouterr().out
    rc = prepare_cli.main(parser.parse_args([MODEL, "--scale", "tiny", "--train", "tp=3", "--no-progress"]))
    assert rc == 2
    assert "--train 'tp=3' makes the trainer tp=3,pp=1,cp=1,ep=8,etp=1,world=16" in (err := capsys.readouterr().err)
    assert "(Qwen3-30B-A3B's run profile tp=" in err
    assert "not divisible by tp*pp*cp = 3" in err


def test_custom_prompt_data(tmp_path):
    src = tmp_path / "my_prompts.jsonl"
    src.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "label": 4}) + "\n")
    result = prep.prepare(_cfg(tmp_path, prompt_data=src, download_only=True), say=lambda s: None)
    assert result.prompts.name == "my_prompts.jsonl"
    assert json.loads(result.prompts.read_text()) == {"prompt": "2+2?", "answer": "4"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not JSON"):
        prep.prepare(_cfg(tmp_path, prompt_data=bad), say=lambda s: None)
