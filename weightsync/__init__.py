"""weightsync: move updated weights from a Megatron-sharded trainer into live sglang-layout
rollout engines, shard to shard, and prove every byte landed."""

__version__ = "0.1.0"
