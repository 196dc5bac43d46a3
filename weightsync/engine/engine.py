"""One engine rank: its parameters, model, checker and broadcast receiver, and batched generation.

Every method that runs the model is collective: all ranks of the engine call it with the same
arguments, in the same order (rank 0's driver broadcasts the calls, see
:mod:`weightsync.engine.control`). Rank 0 samples; the chosen tokens are broadcast, so all ranks
feed the same tokens.

A batch is run to completion (static batching): right-padded prefill of all prompts, then
one decode step per new token for every row, until each row has stopped (``max_new_tokens``, a
stop token, or an abort from rank 0). The KV cache lives for one batch.

Typical usage::

    engine = Engine.build(spec, par, rank, groups, device=torch.device("cpu"))
    engine.load_dummy(seed=0)
    results = engine.generate([GenRequest(rid="a", input_ids=(1, 2, 3), sampling=SamplingParams())])
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.engine.checker import WeightChecker
from weightsync.engine.loader import LoadStats, load_checkpoint, load_dummy, run_post_load
from weightsync.engine.model import Model
from weightsync.engine.sampling import SamplingParams, prompt_logprobs, sample_tokens
from weightsync.engine.tp import EngineGroups
from weightsync.layout.sglang import engine_layout
from weightsync.models.spec import ModelSpec
from weightsync.sync.broadcast_receiver import BroadcastReceiver
from weightsync.sync.p2p_receiver import Receiver
from weightsync.sync.params import ParamStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GenRequest:
    """One generation request, tokenized (picklable: it travels to every rank)."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    """First prompt position whose logprob is returned; -1: no prompt logprobs (sglang default)."""


@dataclass(kw_only=True, slots=True)
class GenResult:
    """The outcome of one request (rank 0)."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict[str, object] | None = None


class Engine:
    """One rank of a rollout engine (see the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        store: ParamStore,
        groups: EngineGroups,
        compute_dtype: torch.dtype,
        eos_token_ids: tuple[int, ...] = (),
        p2p: Receiver | None = None,
    ) -> None:
        self.spec = spec
        self.store = store
        self.groups = groups
        self.rank = groups.rank
        self.model = Model(spec, store, groups, compute_dtype)
        self.checker = WeightChecker(store)
        self.broadcast = BroadcastReceiver(store, spec, groups.rank)
        self.p2p = p2p if p2p is not None else Receiver("none", None, None, groups.rank)
        self.eos_token_ids = eos_token_ids
        self._seed_gen = torch.Generator().manual_seed(1234 + groups.rank)

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        groups: EngineGroups,
        *,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        transport: str = "none",
        transport_options: dict[str, Any] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> Engine:
        """Allocate the rank's parameters (zeros) in the sglang layout and build the model.

        Args:
            spec: the model.
            groups: this rank's groups (``groups.par`` is the engine's parallel config).
            device: parameter and compute device.
            compute_dtype: activation dtype (default: float32 on CPU, the spec's dtype on CUDA).
            transport: the p2p transport the parameters are registered with
                (:data:`weightsync.sync.p2p_receiver.RECEIVER_TRANSPORTS`; ``none``: a plain allocation).
            transport_options: the transport's constructor options.
            eos_token_ids: tokens that end a request unless it sets ``ignore_eos``.
        """
        layout = engine_layout(spec, groups.par, groups.rank)
        p2p, store = Receiver.open(transport, layout, device=device, rank=groups.rank, options=transport_options)
        if compute_dtype is None:
            compute_dtype = torch.float32 if device.type == "cpu" else getattr(torch, spec.dtype)
        logger.info("[rank%d] allocated %d parameters, %.1f MB", groups.rank, len(layout), store.nbytes / 1e6)
        return cls(spec, store, groups, compute_dtype, eos_token_ids, p2p)

    # ------------------------------------------------------------------ weights

    def load_checkpoint(self, path: str) -> LoadStats:
        return load_checkpoint(self.store, self.spec, path)

    def load_dummy(self, seed: int = 0) -> LoadStats:
        return load_dummy(self.store, self.spec, seed)

    def post_load(self) -> float:
        """Recompute derived tensors; seconds."""
        return run_post_load(self.store, self.spec)

    def transfer_info(self) -> tuple[str, dict[str, list[int]], dict[str, Any] | None]:
        """``(session id, {name: [ptr, numel, element_size]}, transport descriptor or None)``."""
        return self.p2p.session_id, self.store.transfer_info(), self.p2p.descriptor()

    def close(self) -> None:
        self.broadcast.close()
        self.store.close()
        self.p2p.close()

    # ------------------------------------------------------------------ forward

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Full-vocab float32 logits ``[len(p), vocab]`` of each prompt, computed as one padded batch."""
        lens = [len(p) for p in prompts]
        ids, positions = self._padded(prompts)
        cache = self.model.new_cache(len(prompts), max(lens))
        logits = self.model.logits(self.model.hidden(ids, positions, cache))
        return [logits[b, : lens[b]].cpu() for b in range(len(prompts))]

    def _padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        lmax = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), lmax, dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        positions = torch.arange(lmax).expand(len(prompts), lmax)
        return ids.to(self.store.device), positions.to(self.store.device)

    def generate(self, reqs: list[GenRequest], should_abort: Callable[[], bool] | None = None) -> list[GenResult]:
        """Run one batch to completion (collective).

        Args:
            reqs: the batch (same list on every rank).
            should_abort: polled on rank 0 before each step; True stops the batch, active rows
                finish with reason ``abort``.

        Returns:
            One :class:`GenResult` per request on rank 0 (other ranks: results without tokens).
        """
        dev = self.store.device
        prompts = [list(r.input_ids) for r in reqs]
        lens = torch.tensor([len(p) for p in prompts])
        total = max(len(p) + r.sampling.max_new_tokens for p, r in zip(prompts, reqs))
        cache = self.model.new_cache(len(reqs), total)
        ids, positions = self._padded(prompts)
        hidden = self.model.hidden(ids, positions, cache)
        rows = torch.arange(len(reqs), device=dev)
        results = [GenResult(rid=r.rid) for r in reqs]
        if any(r.return_logprob and r.logprob_start_len >= 0 for r in reqs):
            full = self.model.logits(hidden)
            last = full[rows, lens.to(dev) - 1]
            for b, r in enumerate(reqs):
                if r.return_logprob and r.logprob_start_len >= 0:
                    lp = prompt_logprobs(full[b, : len(prompts[b])], prompts[b])
                    results[b].input_logprobs = lp[r.logprob_start_len :]
        else:
            last = self.model.logits(hidden[rows, lens.to(dev) - 1])
        self._decode(reqs, results, lens.clone(), total, cache, last, should_abort)
        return results

    def _decode(
        self,
        reqs: list[GenRequest],
        results: list[GenResult],
        cur: torch.Tensor,
        total: int,
        cache: list[dict[str, torch.Tensor]],
        logits: torch.Tensor,
        should_abort: Callable[[], bool] | None,
    ) -> None:
        """Sample/feed steps until every row stops; ``cur[b]`` is row b's next position.

        Each step rank 0 broadcasts ``[token per row, advance per row, continue]``: rows that
        got a token feed it at their next position and advance; stopped rows feed a dummy token
        at a clamped position (their cache is no longer read).
        """
        dev = self.store.device
        num = len(reqs)
        gens = [
            torch.Generator().manual_seed(
                r.sampling.sampling_seed
                if r.sampling.sampling_seed is not None
                else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            )
            for r in reqs
        ]
        done = [r.sampling.max_new_tokens == 0 for r in reqs]
        for b in range(num):
            if done[b]:
                results[b].finish_reason = {"type": "length", "length": 0}
        while True:
            ctrl = torch.zeros(2 * num + 1, dtype=torch.int64)
            if self.rank == 0:
                self._step(reqs, results, done, logits, gens, should_abort, ctrl)
            ctrl = self.groups.broadcast_tokens(ctrl.to(dev))
            if not int(ctrl[-1]):
                return
            tokens, advance = ctrl[:num], ctrl[num : 2 * num].bool()
            pos = torch.where(advance, cur.to(dev), torch.clamp(cur.to(dev), max=total - 1))
            hidden = self.model.hidden(tokens[:, None], pos[:, None], cache)
            cur = cur + advance.cpu().to(cur.dtype)
            logits = self.model.logits(hidden[:, 0])

    def _step(
        self,
        reqs: list[GenRequest],
        results: list[GenResult],
        done: list[bool],
        logits: torch.Tensor,
        gens: list[torch.Generator],
        should_abort: Callable[[], bool] | None,
        ctrl: torch.Tensor,
    ) -> None:
        """Rank 0: sample the active rows (or abort them) and fill ``ctrl``."""
        num = len(reqs)
        active = [b for b in range(num) if not done[b]]
        if not active:
            return
        if should_abort is not None and should_abort():
            for b in active:
                done[b] = True
                results[b].finish_reason = {
                    "type": "abort",
                    "message": "generation aborted (pause_generation or shutdown)",
                }
            return
        tokens, logps = sample_tokens(logits[active], [reqs[b].sampling for b in active], [gens[b] for b in active])
        for k, b in enumerate(active):
            self._append(reqs[b], results[b], int(tokens[k]), float(logps[k]))
            done[b] = results[b].finish_reason is not None
            ctrl[b] = tokens[k]
            ctrl[num + b] = 1
        ctrl[-1] = int(not all(done))

    def _append(self, req: GenRequest, res: GenResult, tok: int, logp: float) -> None:
        """Record a row's new token; set its finish reason when it stops."""
        res.output_ids.append(tok)
        if req.return_logprob:
            res.output_logprobs.append(logp)
        stops = set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else set(self.eos_token_ids))
        if tok in stops:
            res.finish_reason = {"type": "stop", "matched": tok}
        elif len(res.output_ids) >= req.sampling.max_new_tokens:
            res.finish_reason = {"type": "length", "length": req.sampling.max_new_tokens}
