"""Real training with megatron-core: a GRPO (or REINFORCE) step on rollout samples.

One step = forward of the rank's ``GPTModel`` on the batch's tokens, a policy-gradient token
loss, backward, gradient all-reduce over the data-parallel groups, and an Adam step on float32
master weights that are copied back into the (bf16) parameters, the mixed-precision scheme of
Megatron's ``Float16OptimizerWithFloat16Params`` in a few lines.

GRPO (what ``run`` trains with, :meth:`MegatronTrainer.grpo_step`): the rollouts come in groups
of ``G`` samples of one prompt; a sample's advantage is its reward normalised within its group,
``A_b = (r_b - mean_g r) / (std_g r + 1e-6)``; with ``rho_bt = exp(logp_bt - logp_rollout_bt)``
the importance ratio of the trainer's current logprob against the one the engine sampled with,

    loss = - sum_bt min(rho_bt A_b, clip(rho_bt, 1 - eps, 1 + eps) A_b) m_bt / sum_bt m_bt

(PPO's clipped surrogate, one optimizer step per batch). The step reports the loss, the gradient
norm, the mean reward and the train/rollout logprob difference ``mean |logp - logp_rollout|``
over the response tokens (the engine and the trainer compute the same model in different
precisions and kernels: the reference CI gates on it).

Rewards: :func:`math_or_token_reward` -- the bundled math prompts' verifiable answer for real
checkpoints, and for synthetic weights (which never solve a problem) a toy reward a random model
can learn, :func:`token_set_reward`: the share of response tokens with an even id. One chosen
token would be sampled with probability about 1/vocab by a random model, so almost every group
would score 0 and carry no gradient; a range of ids (say the lower half) is skewed by what the
prompt holds (with tied embeddings a random model favours the prompt's own ids, ASCII bytes under
the byte tokenizer); even ids are half of every range, so the reward starts near 0.5 with a
spread across the samples of a group, and at the tiny scale the share rises to 1 within a few
steps (measured on CPU and on one H200). At real dimensions the synthetic random-init weights give
logits in the thousands: sampling is deterministic, a group's samples are identical and carry no
advantage (measured at Qwen3-4B ``layers=2``), so there learning needs real weights.

Loss (REINFORCE with a per-batch baseline): with ``A_b = r_b - mean(r)`` the advantage of
sample ``b`` and ``m_bt`` = 1 on the response tokens,

    loss = sum_bt A_b * CE_bt * m_bt / sum_bt m_bt        (CE_bt = -log p(token_bt | prefix))

so minimizing it raises the log-probability of better-than-average samples. The cross entropy is
megatron-core's vocab-parallel one over the *real* vocab: the padded vocab rows are masked out
of the softmax, so logprobs equal those of the HF model.

It runs on CUDA (the GPU path the run loop and ``scripts/gpu_trainer_check.py`` use) and, slowly
but identically, on CPU for tests.

Typical usage (every rank; megatron parallel state initialized)::

    trainer = MegatronTrainer.from_torch_dist(ckpt, spec, par, rank, device="cuda")
    stats = trainer.step(batch_from_samples(samples, device="cuda"))           # REINFORCE
    stats = trainer.grpo_step(grpo_batch(samples, group_size=4, device="cuda"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.sources.megatron_load import load_into_model
from weightsync.sources.megatron_model import build_gpt_model, check_against_layout, megatron_compat, model_tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenBatch:
    """Right-padded token sequences with a response mask and one advantage per sequence."""

    tokens: torch.Tensor
    """[B, S] int64: prompt then response tokens, padded with 0."""
    loss_mask: torch.Tensor
    """[B, S] float32: 1 where the token is a response token the loss covers."""
    advantages: torch.Tensor
    """[B] float32."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, S] float32: at position t, the engine's logprob of token t (response tokens only)."""


def batch_from_samples(samples: list[dict[str, Any]], *, device: str | torch.device = "cpu",
                       baseline: bool = True) -> TokenBatch:
    """Build a :class:`TokenBatch` from rollout samples.

    Args:
        samples: each ``{"prompt_ids": [...], "output_ids": [...], "reward": float}``.
        device: where the tensors go.
        baseline: subtract the batch's mean reward (else the raw reward is the advantage).

    Returns:
        The batch.

    Raises:
        ValueError: an empty batch, or a sample without response tokens.
    """
    if not samples:
        raise ValueError("no samples")
    length = max(len(s["prompt_ids"]) + len(s["output_ids"]) for s in samples)
    tokens = torch.zeros(len(samples), length, dtype=torch.int64)
    mask = torch.zeros(len(samples), length, dtype=torch.float32)
    for b, s in enumerate(samples):
        p, o = list(s["prompt_ids"]), list(s["output_ids"])
        if not o:
            raise ValueError(f"sample {b} has no response tokens")
        tokens[b, :len(p) + len(o)] = torch.tensor(p + o, dtype=torch.int64)
        mask[b, len(p):len(p) + len(o)] = 1.0
    rewards = torch.tensor([float(s["reward"]) for s in samples], dtype=torch.float32)
    adv = rewards - rewards.mean() if baseline else rewards
    return TokenBatch(tokens=tokens.to(device), loss_mask=mask.to(device), advantages=adv.to(device))


def token_set_reward(output_ids: list[int], vocab_size: int) -> float:
    """The toy reward of synthetic weights: the share of ``output_ids`` that are even ids below
    ``vocab_size`` (0 for an empty response); see the module docstring."""
    if not output_ids:
        return 0.0
    return sum(1 for t in output_ids if t % 2 == 0 and 0 <= t < vocab_size) / len(output_ids)


def math_or_token_reward(sample: dict[str, Any], vocab_size: int, *, synthetic: bool) -> float:
    """A sample's reward: :func:`token_set_reward` for synthetic weights, else the math answer's
    (``weightsync.data.math_reward`` of the sample's ``answer`` and ``text``)."""
    if synthetic:
        return token_set_reward(list(sample["output_ids"]), vocab_size)
    from weightsync.data import math_reward

    return math_reward(str(sample.get("answer", "")), str(sample.get("text", "")))


def grpo_batch(samples: list[dict[str, Any]], *, group_size: int, device: str | torch.device = "cpu",
               eps: float = 1e-6) -> TokenBatch:
    """A :class:`TokenBatch` with group-normalised advantages and the rollout logprobs.

    Args:
        samples: consecutive groups of ``group_size`` samples of one prompt, each
            ``{"prompt_ids", "output_ids", "rollout_logprobs" (one per output token), "reward"}``.
        group_size: samples per prompt.
        device: where the tensors go.
        eps: added to a group's reward standard deviation.

    Raises:
        ValueError: the sample count is no multiple of ``group_size``, a sample has no response
            tokens, or its rollout logprobs do not match its output tokens.
    """
    if group_size < 1 or not samples or len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples do not form groups of {group_size}")
    base = batch_from_samples(samples, device="cpu", baseline=False)
    rewards = base.advantages.view(-1, group_size)
    std = rewards.std(dim=1, keepdim=True, unbiased=False) if group_size > 1 else torch.ones_like(rewards)
    adv = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)
    old = torch.zeros_like(base.loss_mask)
    for b, s in enumerate(samples):
        lps, p, o = list(s["rollout_logprobs"]), len(s["prompt_ids"]), len(s["output_ids"])
        if len(lps) != o:
            raise ValueError(f"sample {b}: {len(lps)} rollout logprobs for {o} output tokens")
        old[b, p:p + o] = torch.tensor(lps, dtype=torch.float32)
    return TokenBatch(tokens=base.tokens.to(device), loss_mask=base.loss_mask.to(device), advantages=adv.to(device),
                      rollout_logprobs=old.to(device))


def grpo_loss(model: torch.nn.Module, batch: TokenBatch, vocab_size: int, *, clip_eps: float = 0.2
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's clipped surrogate (module docstring) and its parts: tokens, mean logprob, the
    train/rollout logprob difference, the share of clipped ratios."""
    if batch.rollout_logprobs is None:
        raise ValueError("GRPO needs the rollout logprobs (grpo_batch)")
    logp = token_logprobs(model, batch.tokens, vocab_size)
    mask = batch.loss_mask[:, 1:]
    old = batch.rollout_logprobs[:, 1:]
    count = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old)
    adv = batch.advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    loss = -(surrogate * mask).sum() / count
    with torch.no_grad():
        diff = ((logp - old).abs() * mask).sum() / count
        clipped = (((ratio - 1.0).abs() > clip_eps).float() * mask).sum() / count
    stats = {"tokens": float(mask.sum()), "mean_logprob": float((logp.detach() * mask).sum() / count),
             "logprob_diff": float(diff), "clip_fraction": float(clipped)}
    return loss, stats


def model_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's vocab-parallel logits ``[B, S, Vp/tp]`` (float32) of ``tokens`` ``[B, S]``.

    With sequence parallelism the sequence is right-padded to a multiple of TP for the forward
    (causal attention: padding after a position does not change it) and cut back.
    Collective over the tensor-parallel group.
    """
    from megatron.core import parallel_state

    seq = tokens.shape[1]
    multiple = parallel_state.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
    padded = F.pad(tokens, (0, (-seq) % multiple))
    positions = torch.arange(padded.shape[1], device=tokens.device).expand_as(padded)
    with megatron_compat():
        return model(padded, positions, attention_mask=None)[:, :seq].float()


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) under the model, over the real vocab: [B, S-1] float32.

    Collective over the tensor-parallel group (vocab-parallel logits).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model_logits(model, tokens[:, :-1])
    per_rank = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * per_rank
    pad = torch.arange(first, first + per_rank, device=logits.device) >= vocab_size
    logits = logits.masked_fill(pad, float("-inf"))
    return -vocab_parallel_cross_entropy(logits, tokens[:, 1:])


def reinforce_loss(model: torch.nn.Module, batch: TokenBatch, vocab_size: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The REINFORCE loss of the module docstring, and its parts (token count, mean logprob)."""
    logp = token_logprobs(model, batch.tokens, vocab_size)
    mask = batch.loss_mask[:, 1:]
    count = mask.sum().clamp(min=1.0)
    loss = -(batch.advantages[:, None] * logp * mask).sum() / count
    stats = {"tokens": float(mask.sum()), "mean_logprob": float((logp.detach() * mask).sum() / count)}
    return loss, stats


class MegatronTrainer:
    """One trainer rank training a megatron-core ``GPTModel`` with REINFORCE (module docstring).

    Typical usage::

        init_parallel_state(par)
        trainer = MegatronTrainer.from_torch_dist(ckpt, spec, par, rank, device="cuda")
        for samples in batches:
            print(trainer.step(batch_from_samples(samples, device="cuda")))
    """

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, par: TrainParallel, rank: int, *,
                 lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0) -> None:
        """Wrap a loaded model.

        Args:
            model: this rank's ``GPTModel`` (names and shapes checked against the trainer layout;
                its dtype may differ from the layout's, e.g. float32 for checks).
            spec, par, rank: the model, the parallel sizes, this rank.
            lr, betas, weight_decay: Adam hyper-parameters.
        """
        self.model, self.spec, self.par, self.rank = model, spec, par, rank
        self.layout = check_against_layout(model, spec, par, rank, check_dtype=False)
        self.params: dict[str, torch.Tensor] = model_tensors(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self._master = [p.detach().float().clone() for p in trainable]
        self._trainable = trainable
        self.optimizer = torch.optim.Adam(self._master, lr=lr, betas=betas, weight_decay=weight_decay)
        self.step_count = 0

    @classmethod
    def from_torch_dist(cls, ckpt_dir: str | Path, spec: ModelSpec, par: TrainParallel, rank: int, *,
                        device: str = "cuda", dtype: torch.dtype | None = None, lr: float = 1e-4) -> MegatronTrainer:
        """Build this rank's model, load its shards from a torch_dist checkpoint, wrap it.

        Needs megatron-core's parallel state for ``par`` (and a process group of its world).
        """
        model = build_gpt_model(spec, par, rank, device=device, dtype=dtype)
        load_into_model(model, ckpt_dir, spec, par, rank)
        return cls(model, spec, par, rank, lr=lr)

    @property
    def memory(self) -> dict[str, int]:
        """Bytes of this rank's training state: parameters, float32 master weights, gradients and
        Adam's two moments (gradients and moments counted at their size once allocated)."""
        params = sum(p.numel() * p.element_size() for p in self._trainable)
        master = sum(m.numel() * m.element_size() for m in self._master)
        state = sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        grads = sum(p.numel() * p.element_size() for p in self._trainable)
        return {"params": params, "master_weights": master, "grads": grads, "optimizer_state": state}

    def step(self, batch: TokenBatch | list[dict[str, Any]]) -> dict[str, float]:
        """One REINFORCE step (collective over the job).

        Args:
            batch: a :class:`TokenBatch`, or rollout samples ``{"prompt_ids", "output_ids",
                "reward"}`` (turned into one with :func:`batch_from_samples`).

        Returns:
            ``{"step", "loss", "tokens", "mean_logprob", "grad_norm"}`` (loss before the update).
        """
        if not isinstance(batch, TokenBatch):
            batch = batch_from_samples(batch, device=self._master[0].device)
        self.model.train()
        for p in self._trainable:
            p.grad = None
        loss, stats = reinforce_loss(self.model, batch, self.spec.vocab_size)
        return self._optimize(loss, stats)

    def grpo_step(self, batch: TokenBatch, *, clip_eps: float = 0.2) -> dict[str, float]:
        """One GRPO step (collective over the job) on a :func:`grpo_batch`.

        Returns:
            ``{"step", "loss", "grad_norm", "tokens", "mean_logprob", "logprob_diff",
            "clip_fraction"}`` (loss and logprobs before the update).
        """
        self.model.train()
        for p in self._trainable:
            p.grad = None
        loss, stats = grpo_loss(self.model, batch, self.spec.vocab_size, clip_eps=clip_eps)
        return self._optimize(loss, stats)

    def _optimize(self, loss: torch.Tensor, stats: dict[str, float]) -> dict[str, float]:
        """Backward, gradient reduction, Adam on the master weights, copy back; the step's stats."""
        with megatron_compat():  # the backward of megatron-core's TP collectives asks for the CUDA device
            loss.backward()
        self._all_reduce_grads()
        norm_sq = torch.zeros((), dtype=torch.float32, device=self._master[0].device)
        for p, master in zip(self._trainable, self._master, strict=True):
            master.grad = p.grad.float() if p.grad is not None else torch.zeros_like(master)
            norm_sq += master.grad.pow(2).sum()
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self._trainable, self._master, strict=True):
                p.copy_(master)
        self.step_count += 1
        return {"step": float(self.step_count), "loss": float(loss.detach()), "grad_norm": float(norm_sq.sqrt()),
                **stats}

    def _all_reduce_grads(self) -> None:
        """Make gradients what Megatron's ``finalize_model_grads`` makes them.

        1. Sum over the TP group the gradients of TP-replicated parameters that each TP rank
           sees only part of: sequence-parallel ones (norms, router) and the q/k layernorms
           (each TP rank normalizes other heads).
        2. Average over the data-parallel replicas (expert parameters: over expert-DP).
        """
        from megatron.core import parallel_state

        config = self.model.config
        tp = parallel_state.get_tensor_model_parallel_group()
        dense = parallel_state.get_data_parallel_group(with_context_parallel=True)
        expert = parallel_state.get_expert_data_parallel_group()
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            partial = (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
            if partial and dist.get_world_size(tp) > 1:
                dist.all_reduce(p.grad, group=tp)
            group = expert if getattr(p, "allreduce", True) is False else dense
            size = dist.get_world_size(group)
            if size > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)
