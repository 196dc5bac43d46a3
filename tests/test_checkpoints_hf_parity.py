"""Contract: an engine started on a checkpoint written by Hugging Face ``transformers`` computes the
prompt logprobs transformers computes, within 1e-4 in float32, for every architecture weightsync
serves (Qwen3, Qwen3-MoE, GLM-4.5, GLM-4.7-Flash, DeepSeek-V3 as Kimi-K2 in real block-fp8 format,
GLM-5's GlmMoeDsa and its DeepseekV32 patch), at TP 1, TP 2 and TP 2 / EP 2.

The checkpoints (tests/checkpoint_helpers.py) have shapes unlike any registry scale and
non-default rope and routing fields, YaRN included. Each engine is brought up the way
``weightsync serve MODEL --checkpoint DIR --dtype float32 --compute-dtype float32 --tp N --ep M``
brings it up: its arguments parsed by the CLI parser, the spec read from the checkpoint's
config.json, the checkpoint validated, then every rank built and loaded by the serve bootstrap.
Every multi-rank engine runs in one spawn of two processes, one after the other.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.checkpoint_helpers import FAMILIES, PROMPTS, hf_logprobs, load_hf_model, write_family_checkpoint

pytest.importorskip("transformers")

TOLERANCE = 1e-4
"""Max |engine - transformers| over every prompt position and vocab entry (float32)."""

LAYOUTS: list[tuple[str, list[str]]] = [
    ("tp1", ["--tp", "1"]),
    ("tp2", ["--tp", "2"]),
    ("tp2-ep2", ["--tp", "2", "--ep", "2"]),
]
CASES = [(key, layout) for key in FAMILIES for layout, _ in LAYOUTS if not (key == "qwen3" and "ep" in layout)]
"""Every family at every layout (the dense Qwen3 has no experts to split)."""


def _serve_argv(key: str, ckpt: str, layout: str) -> list[str]:
    flags = dict(LAYOUTS)[layout]
    return ["serve", FAMILIES[key].model, "--scale", "tiny", "--checkpoint", ckpt, "--dtype", "float32",
            "--compute-dtype", "float32", *flags]


def _engine_logprobs(argv: list[str], rank: int, port: int) -> list[torch.Tensor]:
    """Bring one engine rank up as ``weightsync serve`` does; its log-softmax of each prompt."""
    from weightsync.cli import build_parser
    from weightsync.cli.serve import config_from_args
    from weightsync.engine.bootstrap import build_rank, check_config, finish_rank
    from weightsync.models.checkpoint import HFCheckpoint
    from weightsync.models.checkpoint_check import validate_checkpoint

    cfg = config_from_args(build_parser().parse_args(argv))
    spec, par = check_config(cfg)
    assert cfg.checkpoint is not None
    with HFCheckpoint(cfg.checkpoint) as ckpt:
        validate_checkpoint(spec, ckpt)
    engine = build_rank(cfg, spec, par, rank, port)
    try:
        return [torch.log_softmax(x, dim=-1) for x in engine.prompt_logits([list(p) for p in PROMPTS])]
    finally:
        finish_rank(engine)


def _rank_main(rank: int, jobs: list[tuple[str, list[str]]], ports: Any, out: str) -> None:
    """Every job's engine, one after the other; rank 0 picks each rendezvous port just before its
    engine starts (a port picked long before may be taken by then) and hands it to rank 1."""
    torch.set_num_threads(1)
    seen = {}
    for case, argv in jobs:
        if rank == 0:
            port = _free_port()
            ports.put(port)
        else:
            port = ports.get()
        seen[case] = _engine_logprobs(argv, rank, port)
    if rank == 0:
        torch.save(seen, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """For every case: the engine's and transformers' log-probs of every prompt."""
    root = tmp_path_factory.mktemp("hf_parity")
    ckpts, want = {}, {}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for key, family in FAMILIES.items():
            ref_dir = write_family_checkpoint(key, root / key)
            ckpts[key] = str(root / key)
            model = load_hf_model(family, ref_dir)
            want[key] = [hf_logprobs(model, list(p)) for p in PROMPTS]
        got = {f"{key}-tp1": _engine_logprobs(_serve_argv(key, ckpts[key], "tp1"), 0, 0)
               for key in FAMILIES}
        jobs = [(f"{key}-{layout}", _serve_argv(key, ckpts[key], layout)) for key, layout in CASES if layout != "tp1"]
        out = root / "seen.pt"
        ports = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_rank_main, args=(jobs, ports, str(out)), nprocs=2, start_method="spawn")
        got.update(torch.load(Path(out)))
    finally:
        torch.set_num_threads(before)
    return {"got": got, "want": want, "ckpts": ckpts}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("key", "layout"), CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_engine_matches_transformers(parity: dict[str, Any], key: str, layout: str):
    got, want = parity["got"][f"{key}-{layout}"], parity["want"][key]
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        assert g.shape == w.shape == (len(prompt), FAMILIES[key].config["vocab_size"])
        diff = float((g - w).abs().max())
        assert diff <= TOLERANCE, f"{key} {layout}: prompt {prompt}: max |logprob engine - transformers| {diff:.3g}"


def test_reference_forward_matches_transformers(parity: dict[str, Any]):
    """The run's logprob gate compares engines with weightsync's own reference forward
    (weightsync/engine/reference.py); that forward is transformers' too."""
    from weightsync.engine.reference import Reference
    from weightsync.models.resolve import model_spec
    from weightsync.sources.hf_source import read_global_tensors

    for key, family in FAMILIES.items():
        path = parity["ckpts"][key]
        spec = model_spec(family.model, "tiny", checkpoint=path, dtype="float32")
        ref = Reference(spec, read_global_tensors(path, spec))
        for prompt, w in zip(PROMPTS, parity["want"][key], strict=True):
            diff = float((torch.log_softmax(ref.logits(list(prompt)), dim=-1) - w).abs().max())
            assert diff <= TOLERANCE, f"{key}: prompt {prompt}: max |logprob reference - transformers| {diff:.3g}"
