"""Contract: the engine computes the reference's logits in every layout sglang can register that the
two-rank engine tests do not reach (gloo, one spawn per engine size), and holds exactly the
parameters of its layout (names, shapes, dtypes):

* ``embed-attn-tp2``: DP-attention with attention-TP 2 (tp 4, dp 2) -- the embedding split over
  the attention-TP group, as ``VocabParallelEmbedding(use_attn_tp_group=is_dp_attention_enabled())``
  builds it, with the lm_head over TP and, with ``--enable-dp-lm-head``, over attention-TP.
* ``vocab-64x3``: tp 3, where 64 does not divide the padded vocab (300 -> 320): sglang pads to
  ``64 * 3`` (384 rows, 128 per rank) instead.
* ``router-model-dtype``: GLM-4.5-Air's router in the model dtype, as sglang 0.5.16 registers it
  (``serve --router-dtype model``; sglang 0.5.23 and the default: float32).
* ``indexer-apart``: GLM-5's DSA indexer with ``wk`` and ``weights_proj`` apart
  (``serve --disable-dsa-indexer-fusion``; the default, one ``wk_weights_proj``, is every other
  engine test's GLM-5).
* ``shared-apart`` / ``shared-enforced``: GLM-4.7-Flash's shared expert apart at ep 1
  (``--disable-shared-experts-fusion``; sglang's default there fuses it, as every other one-rank
  and tp-2 GLM engine test does), and GLM-5's tiny model (8 routed experts, where sglang does not
  fuse) fused (``--enforce-shared-experts-fusion``).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine_helpers import LOGIT_ATOL, LOGIT_RTOL, PROMPTS, SEED, one_torch_thread  # noqa: F401
from weightsync.engine.reference import Reference
from weightsync.layout.sglang import engine_layout, vocab_shard
from weightsync.models import get_model
from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec


def _specs() -> dict[str, ModelSpec]:
    qwen3 = get_model("Qwen3-4B", "tiny")
    return {
        "Qwen3-30B-A3B": get_model("Qwen3-30B-A3B", "tiny"),
        "Kimi-K2": get_model("Kimi-K2", "tiny"),
        "GLM-4.5-Air": get_model("GLM-4.5-Air", "tiny"),
        "GLM-5": get_model("GLM-5", "tiny"),
        "GLM-4.7-Flash": get_model("GLM-4.7-Flash", "tiny"),
        # 6 heads, 3 kv heads and a dense FFN of 192 split over 3 ranks; vocab 300 (320 is not a multiple of 3).
        "Qwen3-tp3": qwen3.replace(name="Qwen3-tp3", num_attention_heads=6, num_kv_heads=3, intermediate_size=192),
    }


CASES: list[tuple[str, str, RolloutParallel]] = [
    ("embed-attn-tp2", "Qwen3-30B-A3B", RolloutParallel(tp=4, dp=2, ep=2)),
    ("embed-attn-tp2-dplmhead", "Kimi-K2", RolloutParallel(tp=4, dp=2, ep=4, moe_dense_tp=1, dp_lm_head=True)),
    ("vocab-64x3", "Qwen3-tp3", RolloutParallel(tp=3)),
    ("router-model-dtype", "GLM-4.5-Air", RolloutParallel(tp=1, router_fp32=False)),
    ("indexer-apart", "GLM-5", RolloutParallel(tp=1, dsa_indexer_fusion=False)),
    ("shared-apart", "GLM-4.7-Flash", RolloutParallel(tp=1, shared_experts_fusion=False)),
    ("shared-enforced", "GLM-5", RolloutParallel(tp=1, shared_experts_fusion=True)),
]


def _rank_main(rank: int, world: int, port: int, cases: list[tuple[str, str, RolloutParallel]],
               ckpts: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from weightsync.engine.engine import Engine
    from weightsync.engine.tp import EngineGroups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    specs = _specs()
    seen: dict[str, Any] = {}
    for case, model, par in cases:
        engine = Engine.build(specs[model], EngineGroups.build(par, rank), device=torch.device("cpu"))
        engine.load_checkpoint(ckpts[model])
        params = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in engine.store.items()}
        seen[case] = {"logits": engine.prompt_logits([list(p) for p in PROMPTS]), "params": params}
        engine.close()
    if rank == 0:
        torch.save(seen, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Reference]]:
    root = tmp_path_factory.mktemp("layout_options")
    ckpts, refs = {}, {}
    for name, spec in _specs().items():
        tensors = synthetic_hf_tensors(spec, SEED)
        write_hf_checkpoint(root / name, tensors, hf_config_dict(spec))
        ckpts[name] = str(root / name)
        refs[name] = Reference(spec, tensors)
    seen: dict[str, Any] = {}
    for world in sorted({par.tp for _, _, par in CASES}):
        cases = [c for c in CASES if c[2].tp == world]
        out = root / f"seen{world}.pt"
        mp.start_processes(_rank_main, args=(world, _free_port(), cases, ckpts, str(out)), nprocs=world,
                           start_method="spawn")
        seen.update(torch.load(out, weights_only=False))
    return seen, refs


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("case", "model", "par"), CASES, ids=[c[0] for c in CASES])
def test_engine_matches_reference(engines: tuple[dict[str, Any], dict[str, Reference]], case: str, model: str,
                                  par: RolloutParallel) -> None:
    seen, refs = engines
    spec = _specs()[model]
    assert seen[case]["params"] == {t.name: (t.shape, t.dtype) for t in engine_layout(spec, par, 0)}
    for prompt, logits in zip(PROMPTS, seen[case]["logits"], strict=True):
        torch.testing.assert_close(logits, refs[model].logits(list(prompt)), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def test_cases_reach_the_layouts_they_name() -> None:
    """The embedding is split over attention-TP 2 (not replicated, not over TP 4); the tp-3 vocab is
    padded to 64 * 3."""
    specs = _specs()
    assert vocab_shard(specs["Qwen3-30B-A3B"], CASES[0][2], 3, lm_head=False).split == 2
    assert vocab_shard(specs["Kimi-K2"], CASES[1][2], 3, lm_head=True).split == 2
    shard = vocab_shard(specs["Qwen3-tp3"], CASES[2][2], 2, lm_head=False)
    assert (shard.padded_vocab, shard.rows, shard.start, shard.stop) == (384, 128, 256, 300)
    dtypes = {t.name: t.dtype for t in engine_layout(specs["GLM-4.5-Air"], CASES[3][2], 0)}
    assert dtypes["model.layers.1.mlp.gate.weight"] == "bfloat16"
    names = {t.name for t in engine_layout(specs["GLM-5"], CASES[4][2], 0)}
    assert "model.layers.0.self_attn.indexer.weights_proj.weight" in names
    names = {t.name for t in engine_layout(specs["GLM-4.7-Flash"], CASES[5][2], 0)}
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in names
    shapes = {t.name: t.shape for t in engine_layout(specs["GLM-5"], CASES[6][2], 0)}
    assert shapes["model.layers.1.mlp.experts.w13_weight"][0] == specs["GLM-5"].num_experts + 1


def test_fp8_kv_scales_are_published_constant_and_not_checksummed() -> None:
    """Kimi-K2's ``attn_mqa`` / ``attn_mha`` ``k_scale`` and ``v_scale``: float32 scalars at 1.0 (what sglang
    sets after a load without them), published in the transfer table as sglang's ``named_parameters``
    are, left out of checksums (sglang's ``_skip_weight_check``) and fingerprints, and untouched by a
    reset and by the end of a session (which re-zeroes padding)."""
    from weightsync.engine.engine import Engine
    from weightsync.engine.tp import EngineGroups

    spec = get_model("Kimi-K2", "tiny")
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"))
    try:
        engine.load_dummy(SEED)
        names = [t.name for t in engine_layout(spec, RolloutParallel(), 0) if t.constant is not None]
        assert len(names) == 4 * spec.num_layers
        weights = engine.transfer_info().weights
        engine.reset_tensors(seed=3, skip=())
        engine.end_update()
        sums = engine.checker.checksum()["checksums"]
        prints = engine.checker.fingerprint(seed=5)["fingerprints"]
        for n in names:
            assert weights[n][1:] == [1, 4], n
            assert engine.store[n].shape == ()
            assert float(engine.store[n]) == 1.0, n
            assert n not in sums
            assert n not in prints
    finally:
        engine.close()
