"""Hand-written layouts for planner tests: small, and each feature of the planner on purpose.

Global tensors (``FAKE_GLOBALS``):

* ``w``  (8, 16) bf16 -- trainer: rows split over TP 2, replicated over DP 2; engine: rows split
  over TP 2 into a (5, 16) tensor whose last row is padding, plus a derived copy;
* ``norm`` (16,) bf16 -- replicated on every rank; the engine also keeps a float16 copy (cast);
* ``q`` (16, 16) bf16, fp8 block (8, 8) -- trainer: columns split over TP 2; engine: rows split
  over TP 2, stored as float8 with its ``q_scale_inv`` (2, 2) float32;
* ``v`` (8,) bf16 -- trainer rank 0 and 1 hold all of it, ranks 2 and 3 hold one half each
  (overlapping source boxes: the planner refines them into cells); the engine lists it as two
  adjacent pieces (they coalesce into one op).
"""

from __future__ import annotations

from weightsync.layout.box import LocalTensor, Piece
from weightsync.models import get_model
from weightsync.models.hf import GlobalTensor
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.inputs import PlanInputs, build_inputs

FAKE_GLOBALS = {
    "w": GlobalTensor(name="w", shape=(8, 16), dtype="bfloat16"),
    "norm": GlobalTensor(name="norm", shape=(16,), dtype="bfloat16"),
    "q": GlobalTensor(name="q", shape=(16, 16), dtype="bfloat16", block=(8, 8)),
    "q_scale_inv": GlobalTensor(name="q_scale_inv", shape=(2, 2), dtype="float32", quant_of="q", block=(8, 8)),
    "v": GlobalTensor(name="v", shape=(8,), dtype="bfloat16"),
}
FAKE_TRAIN = TrainParallel(world_size=4, tp=2)
FAKE_ROLLOUT = RolloutParallel(tp=2, num_engines=2)


def _t(name: str, shape: tuple[int, ...], dtype: str, *pieces: Piece, derived: bool = False) -> LocalTensor:
    return LocalTensor(name=name, shape=shape, dtype=dtype, pieces=tuple(pieces), derived=derived)


def fake_trainer_layout(spec: object, par: TrainParallel, rank: int) -> list[LocalTensor]:
    r = rank % 2
    v = ([Piece("v", ((0, 8),), ((0, 8),))] if rank < 2
         else [Piece("v", ((4 * (rank - 2), 4 * (rank - 1)),), ((0, 4),))])
    return [
        _t("w_shard", (4, 16), "bfloat16", Piece("w", ((4 * r, 4 * r + 4), (0, 16)), ((0, 4), (0, 16)))),
        _t("norm", (16,), "bfloat16", Piece("norm", ((0, 16),), ((0, 16),))),
        _t("q_shard", (16, 8), "bfloat16", Piece("q", ((0, 16), (8 * r, 8 * r + 8)), ((0, 16), (0, 8)))),
        _t("v_part", (8,) if rank < 2 else (4,), "bfloat16", *v),
    ]


def fake_engine_layout(spec: object, par: RolloutParallel, rank: int) -> list[LocalTensor]:
    r = rank
    return [
        _t("w_pad", (5, 16), "bfloat16", Piece("w", ((4 * r, 4 * r + 4), (0, 16)), ((0, 4), (0, 16)))),
        _t("w_derived", (4, 16), "bfloat16", Piece("w", ((4 * r, 4 * r + 4), (0, 16)), ((0, 4), (0, 16))),
           derived=True),
        _t("norm", (16,), "bfloat16", Piece("norm", ((0, 16),), ((0, 16),))),
        _t("norm16", (16,), "float16", Piece("norm", ((0, 16),), ((0, 16),))),
        _t("q_fp8", (8, 16), "float8_e4m3fn", Piece("q", ((8 * r, 8 * r + 8), (0, 16)), ((0, 8), (0, 16)))),
        _t("q_scale", (1, 2), "float32", Piece("q_scale_inv", ((r, r + 1), (0, 2)), ((0, 1), (0, 2)))),
        _t("v", (8,), "bfloat16", Piece("v", ((0, 4),), ((0, 4),)), Piece("v", ((4, 8),), ((4, 8),))),
    ]


def fake_inputs(trainer=fake_trainer_layout, engine=fake_engine_layout, **kw: object) -> PlanInputs:
    """Planner inputs over the fake layouts (the spec only names the model; globals are the fakes')."""
    inputs = build_inputs(get_model("Qwen3-4B", "tiny"), FAKE_TRAIN, FAKE_ROLLOUT, trainer_layout=trainer,
                          engine_layout=engine, **kw)  # type: ignore[arg-type]
    return PlanInputs(spec=inputs.spec, train=inputs.train, rollout=inputs.rollout,
                      source_layouts=inputs.source_layouts, engine_layouts=inputs.engine_layouts,
                      train_devices=inputs.train_devices, rollout_devices=inputs.rollout_devices,
                      globals=dict(FAKE_GLOBALS))
