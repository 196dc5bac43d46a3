"""Contract: real checkpoints through ``prepare`` and ``run``, with every validation gate on.

* ``prepare MODEL --hf-checkpoint DIR`` then ``run MODEL`` (both modes, one run): the run serves
  DIR's weights (``results.json`` ``meta.weights`` is ``checkpoint:DIR``), validation passes, and
  the engine after its updates computes what transformers computes with the trainer's weights.
  The prepared copy is named by DIR's name, not the model's scale, and ``prepare``, ``run`` and
  ``serve`` describe it alike: the checkpoint's name and its own dimensions, never the embedded
  default's tiny scale.
* ``run MODEL --hf-checkpoint DIR`` of a real-format block-fp8 checkpoint (float8 weights with
  ``weight_scale_inv``, DeepSeek-V3 architecture served as Kimi-K2), in the profile's blocks and in
  blocks of twice their size: validation passes, the step-0 equality check comparing fp8 weights
  within one ULP per side.
* ``prepare`` reads the profile's repository from a pre-filled Hugging Face cache offline
  (``HF_HUB_OFFLINE=1``); offline without a cache it says so in one line and stops, except for
  the embedded default, which uses synthetic weights and says so.
* A checkpoint with a field the engine cannot honour is refused by ``serve`` and ``run``: exit 2,
  one line naming the field, no traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoint_helpers import FAMILIES, PROMPTS, hf_logprobs, load_hf_model, write_family_checkpoint
from tests.e2e_helpers import assert_run_passed, run_cli, serve_engine

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

SEED = 1234
"""The run's trainer seed (RunConfig default)."""


def _engine_prompt_logprobs(url: str, ids: list[int]) -> list[float]:
    from weightsync.sync.engine_client import EngineClient

    client = EngineClient(url)
    try:
        out = client.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                               "return_logprob": True, "logprob_start_len": 0})
    finally:
        client.close()
    out = out[0] if isinstance(out, list) else out
    return [row[0] for row in out["meta_info"]["input_token_logprobs"][1:]]


def test_prepare_then_run_serves_the_checkpoint_and_matches_transformers(tmp_path: Path):
    """Qwen3-MoE with a layer pattern no registry model has, prepared from the checkpoint and run
    in float32 against an engine started from the prepared directory: p2p at step 0, broadcast at
    step 1; afterwards the engine's prompt logprobs equal transformers' with the trainer's step-1
    weights."""
    from weightsync.models.checkpoint import write_hf_checkpoint
    from weightsync.models.fit import embedded_layout
    from weightsync.models.resolve import model_spec
    from weightsync.sources.synthetic import reference_global_tensors

    family = FAMILIES["qwen3_moe"]
    src, ckpt = tmp_path / "downloaded", tmp_path / "ckpt"
    write_family_checkpoint("qwen3_moe", src)
    prep = run_cli(["prepare", family.model, "--hf-checkpoint", str(src), "--dtype", "float32", "--no-progress"],
                   ckpt_dir=ckpt, log_dir=tmp_path / "prep")
    assert prep.returncode == 0, prep.describe()
    assert f"weights: checkpoint:{src.resolve()}" in prep.output
    hf_dir = ckpt / "downloaded"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["datasets", "downloaded", "downloaded_torch_dist"]
    described = "checkpoint downloaded (Qwen3MoeForCausalLM: 4 layers, hidden 40, 4 heads, vocab 130, 6 experts)"
    assert f"model: {described}, run profile {family.model}" in prep.output, prep.output
    _, rollout = embedded_layout(family.model)  # what the run on this machine needs
    serve = [family.model, "--scale", "tiny", "--tp", str(rollout.tp), "--ep", str(rollout.ep), "--dp",
             str(rollout.dp), *(["--enable-dp-lm-head"] if rollout.dp_lm_head else []), "--transport", "shm",
             "--checkpoint", str(hf_dir), "--dtype", "float32", "--compute-dtype", "float32"]
    with serve_engine(serve, tmp_path / "engine.log") as url:
        run = run_cli(["run", family.model, "--mode", "both", "--num-rollout", "1", "--dtype", "float32",
                       "--engine-urls", url], ckpt_dir=ckpt, log_dir=tmp_path / "run")
        assert_run_passed(run, modes=["p2p", "broadcast"])
        assert run.meta["weights"] == f"checkpoint:{src.resolve()}"
        assert "SYNTHETIC" not in run.output
        assert f"model: {described}" in run.output
        assert run.meta["model_description"] == f"{described}, run profile {family.model}"
        got = {tuple(p): _engine_prompt_logprobs(url, list(p)) for p in PROMPTS}
    assert f"serving {described}" in (tmp_path / "engine.log").read_text()
    for out in (prep.output, run.output):
        assert "tiny scale" not in out, out
    spec = model_spec(family.model, "tiny", checkpoint=hf_dir, dtype="float32")
    read = reference_global_tensors(hf_dir, spec, step=1, seed=SEED)
    stepped = tmp_path / "step1"
    write_hf_checkpoint(stepped, {n: read(n) for n in read_names(spec)}, json.loads((src / "config.json").read_text()))
    model = load_hf_model(family, stepped)
    for prompt in PROMPTS:
        want = hf_logprobs(model, list(prompt))[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        diff = float((torch.tensor(got[tuple(prompt)]) - want).abs().max())
        assert diff <= 1e-4, f"prompt {prompt}: engine vs transformers after the updates: {diff:.3g}"


def read_names(spec: object) -> list[str]:
    from weightsync.models.hf import global_tensors

    return [n for n, g in global_tensors(spec).items() if g.quant_of is None]  # type: ignore[arg-type]


@pytest.mark.parametrize("block", [(8, 8), (16, 16)], ids=["profile-blocks", "16x16-blocks"])
def test_run_a_real_fp8_checkpoint(tmp_path: Path, block: tuple[int, int]):
    """[16, 16] blocks are the tiny profile's [8, 8] as Kimi-K2's [128, 128] are its [64, 64]: the
    engine (tp 2) serves them re-blocked where a shard cuts them (kv_b_proj's 56 rows), the trainer
    quantizes into what the engine serves, and every gate passes."""
    src = tmp_path / "kimi-fp8"
    write_family_checkpoint("deepseek_v3", src, fp8_block=block)
    run = run_cli(["run", "Kimi-K2", "--hf-checkpoint", str(src), "--mode", "both", "--num-rollout", "1"],
                  ckpt_dir=tmp_path / "ckpt", log_dir=tmp_path / "run")
    assert_run_passed(run, modes=["p2p", "broadcast"])
    assert run.meta["weights"] == f"checkpoint:{src.resolve()}"


def _cache_checkpoint(hf_home: Path, repo: str, src: Path) -> Path:
    """Put a checkpoint into a Hugging Face cache as a download leaves it (refs/main -> snapshot)."""
    repo_dir = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("0123456789abcdef")
    return snapshot


def _cache_dataset(hf_home: Path, repo: str, lines: list[dict[str, object]]) -> None:
    repo_dir = hf_home / "hub" / f"datasets--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / "fedcba9876543210"
    snapshot.mkdir(parents=True)
    (snapshot / f"{repo.rsplit('/', 1)[-1]}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("fedcba9876543210")


def test_prepare_reads_a_prefilled_hub_cache_offline(tmp_path: Path):
    hf_home = tmp_path / "hf"
    src = tmp_path / "qwen3"
    write_family_checkpoint("qwen3", src)
    snapshot = _cache_checkpoint(hf_home, "Qwen/Qwen3-4B", src)
    prompt = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "label": "4"}
    _cache_dataset(hf_home, "zhuzilin/dapo-math-17k", [prompt])
    offline = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    ckpt = tmp_path / "ckpt"
    prep = run_cli(["prepare", "Qwen3-4B", "--scale", "full", "--train", "tp=1,cp=1,world=1", "--no-progress"],
                   ckpt_dir=ckpt, log_dir=tmp_path / "logs", env=offline)
    assert prep.returncode == 0, prep.describe()
    assert f"weights: checkpoint:{snapshot}" in prep.output
    config = json.loads((ckpt / "Qwen3-4B" / "config.json").read_text())
    assert config["vocab_size"] == FAMILIES["qwen3"].config["vocab_size"]  # the cached model, not the registry's
    assert (ckpt / "Qwen3-4B_torch_dist").is_dir()
    assert json.loads((ckpt / "datasets" / "dapo-math-17k.jsonl").read_text()) == {"prompt": "What is 2 + 2?",
                                                                                   "answer": "4"}

    empty = {"HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    full = run_cli(["prepare", "Qwen3-4B", "--scale", "full", "--no-progress"], ckpt_dir=tmp_path / "ckpt2",
                   log_dir=tmp_path / "logs", env=empty)
    assert full.returncode == 2, full.describe()
    errors = [line for line in full.output.splitlines() if line.startswith("weightsync prepare:")]
    assert len(errors) == 1, full.output
    assert "cannot be reached" in errors[0]
    assert "Qwen/Qwen3-4B" in errors[0]
    assert "--synthetic" in errors[0]
    assert "Traceback" not in full.output
    assert not (tmp_path / "ckpt2" / "Qwen3-4B").exists()
    tiny = run_cli(["prepare", "Qwen3-4B", "--no-progress", "--download-only"], ckpt_dir=tmp_path / "ckpt2",
                   log_dir=tmp_path / "logs", env=empty)
    assert tiny.returncode == 0, tiny.describe()
    assert "SYNTHETIC" in tiny.output


def test_unsupported_field_is_refused_by_serve_and_run(tmp_path: Path):
    src = tmp_path / "gelu"
    write_family_checkpoint("glm4_moe", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (src / "config.json").write_text(json.dumps(cfg))
    for argv in (["serve", "GLM-4.5-Air", "--checkpoint", str(src)],
                 ["run", "GLM-4.5-Air", "--hf-checkpoint", str(src), "--num-rollout", "1"]):
        out = run_cli(argv, ckpt_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs", timeout_s=120)
        assert out.returncode == 2, out.describe()
        assert "Traceback" not in out.output, out.output
        refusal = [line for line in out.output.splitlines() if "hidden_act='gelu'" in line]
        assert len(refusal) == 1, out.output
        assert f"{src}/config.json" in refusal[0]
