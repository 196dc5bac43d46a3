"""The run profiles of the reference system: how it trains and serves each registry model.

Numbers and flags are those of ``RUN_CONFIGS`` in radixark/miles
``examples/infra_features/p2p_weight_transfer/run.py`` (commit 31f1ca9), with 8 GPUs per node,
ETP 1 and sequence parallel everywhere. sglang flags are recorded as the sglang server takes
them (miles passes them as ``--sglang-<flag>``; ``--tp-size`` is miles'
``--rollout-num-gpus-per-engine``). Where run.py enables DP-attention without ``--dp-size``,
sglang's default dp size 1 applies (attention-TP = TP), which is what ``RolloutParallel.dp = 1``
records.

The reference system trains with Megatron-LM's default ``--transformer-impl transformer_engine``
(the TE layer spec), so the MLA profiles (Kimi-K2, GLM-4.7-Flash, the GLM-5 family) keep the MLA
down projections whole on every TP rank (``TrainParallel.mla_down_proj_replicated``): Kimi-K2's
576-row ``kv_a_proj_with_mqa`` split over TP 8 would cut its [64, 64] fp8 blocks.
"""

from __future__ import annotations

from weightsync.models.parallel import GPUS_PER_NODE, RolloutParallel, TrainParallel
from weightsync.models.profiles_base import RunProfile

REFERENCE = "radixark/miles@31f1ca9 examples/infra_features/p2p_weight_transfer/run.py"


def _megatron_args(t: TrainParallel) -> tuple[str, ...]:
    args = [
        "--tensor-model-parallel-size", str(t.tp),
        *(["--sequence-parallel"] if t.sequence_parallel else []),
        "--pipeline-model-parallel-size", str(t.pp),
        "--context-parallel-size", str(t.cp),
        "--expert-model-parallel-size", str(t.ep),
        "--expert-tensor-parallel-size", str(t.etp),
    ]
    if t.pp_last_stage_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(t.pp_last_stage_layers)]
    return tuple(args)


HF_REPOS = {
    "Qwen3-4B": "Qwen/Qwen3-4B",
    "GLM-4.7-Flash": "zai-org/GLM-4.7-Flash",
    "GLM-5_4layer": "Pinaster/GLM-5_4layer",
    "GLM-5_20layer": "Pinaster/GLM-5_20layer",
    "GLM-5": "zai-org/GLM-5",
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
    "GLM-4.5-Air": "zai-org/GLM-4.5-Air",
    "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B-Instruct-2507",
    "Kimi-K2": "moonshotai/Kimi-K2-Instruct",
}
"""Registry model -> the checkpoint repository of run.py ``PREPARE_CONFIGS`` (``hf_repo``)."""
PROMPT_DATASETS = ("zhuzilin/dapo-math-17k",)
"""The prompt data of every profile (run.py's ``--prompt-data``; its eval set aime-2024 is not used here)."""

_CUDA_GRAPH_BS = ("--cuda-graph-bs", "1", "2", "4", "8", "16")


def _nsa_args(gpus_per_engine: int) -> tuple[str, ...]:
    """GLM-5's DSA (NSA) serving flags, shared by its three profiles in run.py."""
    return (
        "--page-size", "64",
        "--nsa-decode-backend", "flashmla_sparse",
        "--nsa-prefill-backend", "flashmla_sparse",
        "--attention-backend", "nsa",
        "--cuda-graph-max-bs", "8",
        "--max-running-requests", "512",
        "--chunked-prefill-size", str(2048 * gpus_per_engine),
        "--watchdog-timeout", "3600",
        "--disable-cuda-graph",
    )


def _profile(model: str, *, nodes: int, train_gpus: int, rollout_gpus: int, tp: int, pp: int = 1, cp: int = 1,
             ep: int = 1, last: int | None = None, engine_gpus: int, mem: float, sgl_ep: int | None = None,
             sgl_dp: int | None = None, moe_dense_tp: int | None = None, dp_attention: bool = False,
             dp_lm_head: bool = False, mla: bool = False, extra: tuple[str, ...] = ()) -> RunProfile:
    train = TrainParallel(world_size=train_gpus, tp=tp, pp=pp, cp=cp, ep=ep, etp=1, pp_last_stage_layers=last,
                          sequence_parallel=True, mla_down_proj_replicated=mla)
    if rollout_gpus % engine_gpus:
        raise ValueError(f"{model}: {rollout_gpus} rollout GPUs is not a multiple of {engine_gpus} GPUs per engine")
    rollout = RolloutParallel(tp=engine_gpus, dp=sgl_dp or 1, ep=sgl_ep or 1,
                              num_engines=rollout_gpus // engine_gpus, moe_dense_tp=moe_dense_tp,
                              dp_lm_head=dp_lm_head)
    sgl = ["--tp-size", str(engine_gpus), "--mem-fraction-static", str(mem)]
    if sgl_ep is not None:
        sgl += ["--ep-size", str(sgl_ep)]
    if sgl_dp is not None:
        sgl += ["--dp-size", str(sgl_dp)]
    if moe_dense_tp is not None:
        sgl += ["--moe-dense-tp-size", str(moe_dense_tp)]
    if dp_attention:
        sgl.append("--enable-dp-attention")
    if dp_lm_head:
        sgl.append("--enable-dp-lm-head")
    sgl += extra
    return RunProfile(model=model, num_nodes=nodes, num_train_gpus=train_gpus, num_rollout_gpus=rollout_gpus,
                      train=train, rollout=rollout, sglang_args=tuple(sgl), megatron_args=_megatron_args(train),
                      gpus_per_node=GPUS_PER_NODE, hf_repo=HF_REPOS[model], prompt_datasets=PROMPT_DATASETS)


def _glm5_profile(model: str, *, nodes: int, gpus: int, pp: int, cp: int, ep: int, last: int | None,
                  engine_gpus: int, mem: float) -> RunProfile:
    return _profile(model, nodes=nodes, train_gpus=gpus, rollout_gpus=gpus, tp=4, pp=pp, cp=cp, ep=ep, last=last,
                    engine_gpus=engine_gpus, mem=mem, sgl_ep=engine_gpus, sgl_dp=engine_gpus, moe_dense_tp=1,
                    dp_attention=True, dp_lm_head=True, mla=True, extra=_nsa_args(engine_gpus))


PROFILES: dict[str, RunProfile] = {
    "Qwen3-4B": _profile("Qwen3-4B", nodes=1, train_gpus=4, rollout_gpus=4, tp=2, cp=2, engine_gpus=2, mem=0.8),
    "GLM-4.7-Flash": _profile(
        "GLM-4.7-Flash", nodes=2, train_gpus=8, rollout_gpus=8, tp=4, ep=8, engine_gpus=4, mem=0.7, sgl_ep=4,
        dp_attention=True, dp_lm_head=True, mla=True, extra=_CUDA_GRAPH_BS,
    ),
    "GLM-5_4layer": _glm5_profile("GLM-5_4layer", nodes=2, gpus=8, pp=1, cp=1, ep=8, last=None, engine_gpus=8, mem=0.7),
    "GLM-5_20layer": _glm5_profile("GLM-5_20layer", nodes=12, gpus=48, pp=3, cp=1, ep=16, last=6, engine_gpus=16,
                                   mem=0.7),
    "GLM-5": _glm5_profile("GLM-5", nodes=32, gpus=128, pp=8, cp=2, ep=16, last=8, engine_gpus=64, mem=0.9),
    "Qwen3-30B-A3B": _profile(
        "Qwen3-30B-A3B", nodes=4, train_gpus=16, rollout_gpus=16, tp=4, ep=8, engine_gpus=8, mem=0.8, sgl_ep=8,
        dp_attention=True, dp_lm_head=True, extra=_CUDA_GRAPH_BS,
    ),
    "GLM-4.5-Air": _profile(
        "GLM-4.5-Air", nodes=8, train_gpus=32, rollout_gpus=32, tp=1, pp=4, ep=8, last=10, engine_gpus=8, mem=0.8,
        sgl_ep=8, dp_attention=True, dp_lm_head=True, extra=_CUDA_GRAPH_BS,
    ),
    "Qwen3-235B-A22B": _profile(
        "Qwen3-235B-A22B", nodes=16, train_gpus=64, rollout_gpus=64, tp=4, pp=4, cp=2, ep=16, last=22,
        engine_gpus=32, mem=0.75, sgl_ep=32, sgl_dp=1, dp_attention=True, dp_lm_head=True, extra=_CUDA_GRAPH_BS,
    ),
    "Kimi-K2": _profile(
        "Kimi-K2", nodes=64, train_gpus=256, rollout_gpus=256, tp=8, pp=8, cp=4, ep=32, last=5, engine_gpus=32,
        mem=0.7, sgl_ep=32, sgl_dp=8, moe_dense_tp=1, dp_attention=True, dp_lm_head=True, mla=True,
        extra=(*_CUDA_GRAPH_BS, "--moe-runner-backend", "triton", "--fp8-gemm-backend", "triton"),
    ),
}
"""Registry model name -> the reference system's run profile (run.py ``RUN_CONFIGS``; its keys
``Qwen3-235B-A22B-Instruct-2507`` and ``Kimi-K2-Instruct`` are registered under the model names)."""


def list_profiles() -> list[str]:
    """Names of the models that have a reference run profile."""
    return list(PROFILES)


def get_profile(name: str) -> RunProfile:
    """The reference run profile of a registry model.

    Args:
        name: exact registry name.

    Returns:
        The :class:`RunProfile`.

    Raises:
        ValueError: no profile of that name (the message lists the known ones).
    """
    profile = PROFILES.get(name)
    if profile is None:
        raise ValueError(f"no run profile {name!r}; known profiles: {', '.join(PROFILES)}")
    return profile
