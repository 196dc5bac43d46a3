"""The run profile record: one model with the reference system's train and rollout layout."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.models.parallel import GPUS_PER_NODE, RolloutParallel, TrainParallel


@dataclass(frozen=True, kw_only=True, slots=True)
class RunProfile:
    """How the reference system runs one model: nodes, Megatron sizes, sglang sizes and flags."""

    model: str
    """Registry model name."""
    num_nodes: int
    num_train_gpus: int
    num_rollout_gpus: int
    train: TrainParallel
    rollout: RolloutParallel
    sglang_args: tuple[str, ...] = ()
    """The sglang server flags of the reference run.py (for display and for real sglang)."""
    megatron_args: tuple[str, ...] = ()
    """The Megatron parallel flags of the reference run.py."""
    gpus_per_node: int = GPUS_PER_NODE
    hf_repo: str = ""
    """The Hugging Face repository ``prepare`` fetches the checkpoint from (run.py ``PREPARE_CONFIGS``)."""
    prompt_datasets: tuple[str, ...] = ()
    """Hugging Face dataset repositories of the prompt data ``prepare`` fetches (the first is the run's)."""

    def __post_init__(self) -> None:
        if self.train.world_size != self.num_train_gpus:
            raise ValueError(f"{self.model}: train world {self.train.world_size} != {self.num_train_gpus} GPUs")
        if self.rollout.world_size != self.num_rollout_gpus:
            raise ValueError(f"{self.model}: rollout world {self.rollout.world_size} != {self.num_rollout_gpus} GPUs")
