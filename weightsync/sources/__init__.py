"""Weight sources of the trainer side: the synthetic CPU trainer, the megatron-core adapter and
training step, Megatron torch_dist shards, Hugging Face checkpoint reading, and ``prepare``.

See docs/trainer.md.
"""
