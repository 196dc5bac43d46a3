"""Contract: every model family provides every piece a family needs (CONTRIBUTING.md, "Adding a
model family"), and every test that checks a family in depth runs it.

For each ``Family`` member, on each registry model of it at tiny scale (trainer TP 2, engine TP 2;
EP 2 where the model has experts):

1. ``models/registry.py`` and ``models/profiles.py``: a registry model of the family, with a run
   profile naming the Hugging Face repository ``prepare`` fetches.
2. ``models/config.py``: its HF architecture maps to the family, with transformers' defaults of
   that architecture; ``models/checkpoint.py`` writes its ``config.json``, which reads back into
   the same spec.
3. ``models/hf.py``: its global tensors; ``models/checkpoint.py``: a synthetic value of each, of the
   table's shape and dtype.
4. ``layout/megatron*.py``: the trainer ranks' pieces cover every element of every global tensor
   the trainer holds (all but the fp8 scales the sender computes).
5. ``layout/sglang*.py``: the engine ranks' pieces cover every element of every global tensor.
6. ``sources/dist_layout.py``: the torch_dist checkpoint stores every piece of every trainer rank's
   local tensors (each module is known as column- or row-parallel, each axis placed).
7. ``sources/megatron_model.py``: megatron-core's ``TransformerConfig`` of the family builds (the
   live model with ``sources/megatron_modules.py``'s attention and norms: 8).
8. The per-family depth tests list a model of the family: the engine forward against the
   reference forward (``engine/model.py``, ``engine/reference.py``), parity with transformers on a
   transformers-written checkpoint, the live megatron-core model and its checkpoint format, the
   torch_dist round trip, the plan simulation, and an end-to-end run in both modes.
"""

from __future__ import annotations

import pytest
import torch

from tests import checkpoint_helpers, engine_helpers, test_e2e_families, test_plan_simulate, test_sources_megatron
from tests import test_sources_torch_dist as torch_dist_tests
from weightsync.layout.box import Box, box_slices
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model, get_profile, list_models
from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensor
from weightsync.models.config import ARCHITECTURES, HF_DEFAULTS, spec_from_hf_config
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.models.spec import Family, ModelSpec
from weightsync.sources.dist_layout import chunks_of

MODELS_OF: dict[Family, list[str]] = {f: [m for m in list_models() if get_model(m, "tiny").family is f]
                                      for f in Family}
CASES = [pytest.param(m, id=m) for f in Family for m in MODELS_OF[f]]


def _sizes(spec: ModelSpec) -> tuple[TrainParallel, RolloutParallel]:
    ep = 2 if spec.is_moe else 1
    return TrainParallel(world_size=2 * ep, tp=2, ep=ep, etp=1), RolloutParallel(tp=2, ep=ep)


def _uncovered(shapes: dict[str, tuple[int, ...]], pieces: list[tuple[str, Box]]) -> list[str]:
    """Names of the tensors of ``shapes`` that ``pieces`` (name, box) leave an element of uncovered."""
    seen = {n: torch.zeros(s, dtype=torch.bool) for n, s in shapes.items()}
    for name, box in pieces:
        seen[name][box_slices(box)] = True
    return sorted(n for n, s in seen.items() if not s.all())


@pytest.mark.parametrize("family", list(Family))
def test_every_family_has_a_registry_model_with_a_profile(family: Family):
    assert MODELS_OF[family], f"no registry model of family {family.value}: add one (CONTRIBUTING.md)"
    for model in MODELS_OF[family]:
        assert get_profile(model).hf_repo, f"{model}: its run profile names no Hugging Face repository"


@pytest.mark.parametrize("model", CASES)
def test_config_json_round_trip(model: str):
    spec = get_model(model, "tiny")
    assert ARCHITECTURES[spec.hf_architecture] is spec.family
    assert spec.hf_architecture in HF_DEFAULTS, f"{spec.hf_architecture}: no transformers defaults"
    back = spec_from_hf_config(hf_config_dict(spec), name=spec.name, fp8_block=spec.fp8_block, scale=spec.scale,
                               sources=spec.sources)
    assert back == spec


@pytest.mark.parametrize("model", CASES)
def test_global_tensors_and_synthetic_weights(model: str):
    spec = get_model(model, "tiny")
    table = global_tensors(spec)
    assert table
    for name, g in table.items():
        t = synthetic_hf_tensor(spec, name, table=table)
        assert (tuple(t.shape), str(t.dtype).removeprefix("torch.")) == (g.shape, g.dtype), name


@pytest.mark.parametrize("model", CASES)
def test_both_layouts_and_the_checkpoint_format_cover_the_model(model: str):
    spec = get_model(model, "tiny")
    train, rollout = _sizes(spec)
    table = global_tensors(spec)
    held = {n: g.shape for n, g in table.items() if g.quant_of is None}  # fp8 scales: computed by the sender
    trainer = [trainer_layout(spec, train, r) for r in range(train.world_size)]
    assert _uncovered(held, [(p.global_name, p.global_box) for ts in trainer for t in ts for p in t.pieces]) == []
    engine = [engine_layout(spec, rollout, r) for r in range(rollout.world_size)]
    assert _uncovered({n: g.shape for n, g in table.items()},
                      [(p.global_name, p.global_box) for ts in engine for t in ts for p in t.pieces]) == []
    for rank, tensors in enumerate(trainer):
        for t in tensors:
            stored = [c.local_box for c in chunks_of(spec, train, rank, t)]
            assert _uncovered_pieces(t.shape, stored, [p.local_box for p in t.pieces]) == 0, (rank, t.name)


def _uncovered_pieces(shape: tuple[int, ...], stored: list[Box], pieces: list[Box]) -> int:
    """How many of ``pieces`` (boxes of a local tensor) the ``stored`` boxes leave an element of out."""
    seen = torch.zeros(shape, dtype=torch.bool)
    for box in stored:
        seen[box_slices(box)] = True
    return sum(1 for box in pieces if not seen[box_slices(box)].all())


@pytest.mark.parametrize("model", CASES)
def test_megatron_core_config_builds(model: str):
    from weightsync.sources.megatron_model import transformer_config  # megatron-core: seconds to import

    spec = get_model(model, "tiny")
    config = transformer_config(spec, _sizes(spec)[0])
    assert type(config).__name__ == ("MLATransformerConfig" if spec.is_mla else "TransformerConfig")


DEPTH_TESTS: dict[str, set[str]] = {
    "tests/test_engine_forward.py (engine vs reference forward)": set(engine_helpers.FAMILY_MODELS),
    "tests/test_checkpoints_hf_parity.py (transformers-written checkpoints)":
        {f.model for f in checkpoint_helpers.FAMILIES.values()},
    "tests/test_sources_megatron.py (live megatron-core model, checkpoint format)": set(test_sources_megatron.MODELS),
    "tests/test_sources_torch_dist.py (torch_dist round trip)": set(torch_dist_tests.FAMILY_MODELS),
    "tests/test_plan_simulate.py (plan simulation)": {p.values[0] for p in test_plan_simulate.CASES},
    # Qwen3-4B runs end to end through the wrappers (tests/test_e2e_cli.py)
    "tests/test_e2e_families.py (both modes end to end)": {p.values[0] for p in test_e2e_families.FAMILIES}
    | {"Qwen3-4B"},
}


@pytest.mark.parametrize("family", list(Family))
@pytest.mark.parametrize("where", list(DEPTH_TESTS))
def test_every_depth_test_runs_the_family(family: Family, where: str):
    assert DEPTH_TESTS[where] & set(MODELS_OF[family]), f"{where} runs no model of family {family.value}"
