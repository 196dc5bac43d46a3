"""One engine rank: its parameters, model, checker and broadcast receiver, and batched generation.

Every method that runs the model is collective: all ranks of the engine call it with the same
arguments, in the same order (rank 0's driver broadcasts the calls, see
:mod:`weightsync.engine.control`). Rank 0 samples; the chosen tokens are broadcast, so all ranks
feed the same tokens.

A batch is run to completion (static batching): right-padded prefill of all prompts, then
one decode step per new token for every row, until each row has stopped (``max_new_tokens``, a
stop token, or an abort from rank 0). The KV cache lives for one batch.

A failure on rank 0 while it seeds or samples a step (a request whose numbers the kernels cannot
compute, a stop pattern that raises) does not leave the other ranks waiting in the token broadcast: rank 0
broadcasts a fault flag, every rank leaves the batch, and rank 0 raises :class:`StepError`. A row
whose logits or probabilities are not finite ends alone, with finish reason ``abort`` and a
message (``status_code`` 500); the batch's other rows go on.

Weights: the rank holds one or two copies of its parameters (:attr:`Engine.copies`,
:mod:`weightsync.sync.weight_copies`); the model reads the served one. Every write of an update
session, its post-load and its verification use the session's copy
(:meth:`Engine.session_store`): the served copy itself for a session written in place, else a
shadow that :meth:`Engine.begin_update` refreshes from the served copy and :meth:`Engine.publish`
flips in (a swap or a copy). During a batch, rank 0 may publish between two decode steps
(``take_flip``): it broadcasts the flip with the step's tokens, so every rank flips at the same
step and no forward step reads two versions; the running requests keep their KV and record the
output index from which their tokens come from the new version (:attr:`GenResult.version_spans`).

Typical usage::

    engine = Engine.build(spec, par, rank, groups, device=torch.device("cpu"))
    engine.load_dummy(seed=0)
    results = engine.generate([GenRequest(rid="a", input_ids=(1, 2, 3), sampling=SamplingParams())])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.engine.checker import WeightChecker
from weightsync.engine.config import SHADOW_MODES
from weightsync.engine.loader import LoadStats, load_checkpoint, load_dummy, run_post_load
from weightsync.engine.model import Model
from weightsync.engine.sampling import SamplingParams, generator_seed, prompt_logprobs, sample_tokens
from weightsync.engine.stops import match_stop
from weightsync.engine.tensor_payload import decode_named_tensors
from weightsync.engine.tp import EngineGroups
from weightsync.layout.sglang import engine_layout
from weightsync.models.spec import ModelSpec
from weightsync.sync.broadcast_receiver import DEFAULT_TIMEOUT_S as DEFAULT_GROUP_TIMEOUT_S
from weightsync.sync.broadcast_receiver import BroadcastReceiver, check_update_request
from weightsync.sync.p2p_receiver import Receiver
from weightsync.sync.params import ParamStore, write_global
from weightsync.sync.peer_sender import PeerDonation
from weightsync.sync.weight_copies import WeightCopies, shadow_fits
from weightsync.transport import TransportConfig
from weightsync.transport.config import NONE

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
    top_logprobs_num: int = 0
    """With ``return_logprob``: the top-N alternatives of every returned position."""
    token_ids_logprob: tuple[int, ...] = ()
    """With ``return_logprob``: the logprobs of these tokens at every returned position."""
    prior_output_ids: tuple[int, ...] = ()
    """Tokens this request generated before it was retracted (the tail of ``input_ids``): they
    count toward ``max_new_tokens``, ``min_new_tokens``, penalties and stop strings."""


TopLogprobs = list[tuple[float, int]]
"""``(logprob, token id)`` alternatives of one position."""


@dataclass(kw_only=True, slots=True)
class GenResult:
    """The outcome of one request (rank 0); the token lists hold what this run generated."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs | None] | None = None
    input_token_ids_logprobs: list[TopLogprobs | None] | None = None
    finish_reason: dict[str, object] | None = None
    num_retractions: int = 0
    version_spans: list[tuple[int, str]] = field(default_factory=list)
    """``(first output index, weight version)``: from the engine, the flips during this run;
    from the scheduler, every version of the answer, the one it started with first."""


@dataclass(frozen=True, slots=True)
class FlipAt:
    """A publication rank 0 applies at the next step boundary of the running batch."""

    version: str
    """The version the flip publishes (recorded in the running requests' spans)."""
    done: Callable[[dict[str, Any]], None]
    """Called on rank 0 once it flipped, with :meth:`Engine.publish`'s answer."""


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """What one rank publishes for senders (``/get_remote_instance_transfer_engine_info``)."""

    session_id: str
    weights: dict[str, list[int]]
    """sglang's table: ``{name: [ptr, numel, element_size]}`` of the home copy (copy 0)."""
    descriptor: dict[str, Any] | None
    """The transport's descriptor (an extension), None without a transport."""
    copies: list[dict[str, list[int]]]
    """The same table for every published copy, copy 0 first (an extension: a swap's target)."""
    shadow: dict[str, Any]
    """:meth:`~weightsync.sync.weight_copies.WeightCopies.describe`."""


class StepError(RuntimeError):
    """Rank 0 failed while sampling a step; every rank left the batch (the engine is consistent)."""


FAULT = 2
"""The continue flag rank 0 broadcasts when its step failed (0: done, 1: go on)."""


class Engine:
    """One rank of a rollout engine (see the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        copies: WeightCopies,
        groups: EngineGroups,
        compute_dtype: torch.dtype,
        eos_token_ids: tuple[int, ...] = (),
        p2p: Receiver | None = None,
        group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        bind_host: str | None = None,
    ) -> None:
        self.spec = spec
        self.copies = copies
        self.groups = groups
        self.rank = groups.rank
        self.model = Model(spec, copies.served_store, groups, compute_dtype)
        c = groups.coords
        self.checker = WeightChecker(
            copies.served_store,
            parallelism_info={
                "tp_rank": c.tp_rank,
                "tp_size": c.tp_size,
                "dp_rank": c.attn_dp_rank,
                "dp_size": c.attn_dp_size,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": groups.rank,
                "size": groups.world,
            },
        )
        self.p2p = p2p if p2p is not None else Receiver(NONE, None, None, groups.rank)
        self.broadcast = BroadcastReceiver(self.session_store, spec, groups.rank, timeout_s=group_timeout_s,
                                           bind_host=bind_host)
        self.eos_token_ids = eos_token_ids
        self.decode: Callable[[list[int]], str] | None = None
        """Rank 0's detokenizer (stop strings); set by the server."""
        self._seed_gen = torch.Generator().manual_seed(1234 + groups.rank)
        self.donation: PeerDonation | None = None
        """This rank's copy to a joining peer engine (the last one started)."""

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        groups: EngineGroups,
        *,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        transport: TransportConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        bind_host: str | None = None,
        shadow: str = "auto",
    ) -> Engine:
        """Allocate the rank's parameters (zeros) in the sglang layout and build the model.

        Args:
            spec: the model.
            groups: this rank's groups (``groups.par`` is the engine's parallel config).
            device: parameter and compute device.
            compute_dtype: activation dtype (default: float32 on CPU, the spec's dtype on CUDA).
            transport: the p2p transport the parameters are registered with (a kind an engine
                receives through, :meth:`~weightsync.sync.p2p_receiver.Receiver.open`); None: a plain
                allocation.
            eos_token_ids: tokens that end a request unless it sets ``ignore_eos``.
            group_timeout_s: the deadline of joining a weight-update group and of a broadcast receive.
            bind_host: the local address weight-update groups listen on (default: the route to their master).
            shadow: ``auto`` (a shadow copy for pause-free updates on CPU, and on a GPU where
                :func:`shadow_fits`) or ``off``.

        Raises:
            ValueError: an unknown ``shadow``.
        """
        if shadow not in SHADOW_MODES:
            raise ValueError(f"shadow must be one of {', '.join(SHADOW_MODES)}, got {shadow!r}")
        layout = engine_layout(spec, groups.par, groups.rank)
        nbytes = ParamStore.required_bytes(layout)
        want = shadow == "auto" and shadow_fits(nbytes, device)
        if shadow == "auto" and not want:
            logger.warning("[rank%d] no room for a shadow copy of %.1f MB on %s: updates pause generation",
                           groups.rank, nbytes / 1e6, device)
        p2p, copies = Receiver.open(transport, layout, device=device, rank=groups.rank, shadow=want)
        if compute_dtype is None:
            compute_dtype = torch.float32 if device.type == "cpu" else getattr(torch, spec.dtype)
        logger.info("[rank%d] allocated %d parameters, %d copies of %.1f MB (%s)", groups.rank, len(layout),
                    len(copies.stores), nbytes / 1e6, copies.describe())
        return cls(spec, copies, groups, compute_dtype, eos_token_ids, p2p, group_timeout_s, bind_host)

    # ------------------------------------------------------------------ weights

    @property
    def store(self) -> ParamStore:
        """The served copy of the parameters (what the model reads)."""
        return self.copies.served_store

    def session_store(self) -> ParamStore:
        """The copy the open update session writes, post-loads and verifies (the served one when
        no session is open)."""
        return self.copies.session_store()

    def load_checkpoint(self, path: str) -> LoadStats:
        """Load the served parameters from a checkpoint (start-up)."""
        return load_checkpoint(self.store, self.spec, path)

    def load_dummy(self, seed: int = 0) -> LoadStats:
        return load_dummy(self.store, self.spec, seed)

    def update_from_disk(self, path: str) -> LoadStats:
        """``/update_weights_from_disk`` inside a session: the checkpoint into the session's copy."""
        return load_checkpoint(self.session_store(), self.spec, path)

    def post_load(self) -> float:
        """Recompute the served copy's derived tensors; seconds."""
        return run_post_load(self.store, self.spec)

    def begin_update(self, pause_free: bool = False, flip: str = "swap") -> dict[str, Any]:
        """A session begins: its copy is chosen and, when it is not the served one, refreshed
        from it (:meth:`~weightsync.sync.weight_copies.WeightCopies.begin`)."""
        return self.copies.begin(pause_free=pause_free, flip=flip)

    def end_update(self) -> float:
        """A session ends: its copy's padding is zeroed again (a writer of whole padded tensors may
        have written it), then its derived tensors are recomputed; seconds."""
        t0 = time.perf_counter()
        self.session_store().zero_padding()
        return time.perf_counter() - t0 + run_post_load(self.session_store(), self.spec)

    def publish(self) -> dict[str, Any]:
        """The session's copy becomes the served one (a flip; nothing for a session written in
        place) and the session closes; ``{"flip", "seconds", "served"}``."""
        out = self.copies.flip()
        self.model.store = self.checker.store = self.copies.served_store
        return out

    def abort_update(self) -> None:
        """The session closes unpublished (the served copy is as it was unless written in place)."""
        self.copies.abort()

    def reset_tensors(self, seed: int, skip: tuple[str, ...]) -> dict[str, int]:
        """The checker's ``reset_tensors`` on the served parameters (and on the session's copy)."""
        self.checker.store = self.store
        out = self.checker.reset_tensors(seed, skip)
        if self.session_store() is not self.store:
            self.session_store().copy_from(self.store)
        return out

    def checker_on(self, action: str) -> WeightChecker:
        """The checker, over the copy ``action`` looks at: ``snapshot`` the served copy (what was
        loaded), ``compare``, ``checksum`` and ``fingerprint`` the session's (what an update wrote)."""
        self.checker.store = self.store if action == "snapshot" else self.session_store()
        return self.checker

    def update_from_tensor(self, entries: list[str], load_format: str | None) -> dict[str, Any]:
        """``/update_weights_from_tensor`` on this rank: decode entry ``rank`` and write it.

        ``load_format`` None or ``"flattened_bucket"``: full HF tensors (each rank keeps its
        pieces, fp8 weights quantized on arrival as on the broadcast path); ``"direct"``: this
        rank's parameters by their own names, copied as they are.

        Raises:
            ValueError: a missing entry, an undecodable payload, unknown names, wrong shapes or
                dtypes (all offenders named); nothing is written then.
        """
        if len(entries) <= self.rank:
            raise ValueError(
                f"serialized_named_tensors has {len(entries)} entries; engine rank {self.rank} needs its own "
                f"(one entry per TP rank)"
            )
        pairs = decode_named_tensors(entries[self.rank], load_format)
        target = self.session_store()
        t0 = time.perf_counter()
        nbytes = 0
        if load_format == "direct":
            bad = [
                f"{n}: {list(t.shape)} {t.dtype}" for n, t in pairs
                if n not in self.store or self.store[n].shape != t.shape or self.store[n].dtype != t.dtype
            ]
            if bad:
                raise ValueError(f"update_weights_from_tensor (direct) refused {len(bad)} tensors: " + "; ".join(bad))
            for n, t in pairs:
                target[n].copy_(t)
                nbytes += t.numel() * t.element_size()
        else:
            check_update_request(
                self.spec, [n for n, _ in pairs], [str(t.dtype) for _, t in pairs], [list(t.shape) for _, t in pairs],
                what="update_weights_from_tensor",
            )
            for n, t in pairs:
                nbytes += write_global(target, self.spec, n, lambda box, t=t: t[tuple(slice(a, b) for a, b in box)])
        return {"num_tensors": len(pairs), "nbytes": nbytes, "seconds": time.perf_counter() - t0}

    def transfer_info(self) -> TransferInfo:
        """What senders need: sglang's ``(session id, {name: [ptr, numel, element_size]})`` of the
        home copy, the transport descriptor, every published copy's table and the copies' facts.

        Like sglang, only the model's parameters are listed: derived tensors (MLA ``w_kc`` /
        ``w_vc``, which sglang keeps as plain attributes computed in post-load) are left out, so
        no sender can address them; ``end_weight_update`` recomputes them.
        """
        derived = set(self.store.derived_names())
        tables = [{n: v for n, v in t.items() if n not in derived} for t in self.copies.tables()]
        return TransferInfo(session_id=self.p2p.session_id, weights=tables[0], descriptor=self.p2p.descriptor(),
                            copies=tables, shadow=self.copies.describe())

    def close(self) -> None:
        self.broadcast.close()
        self.copies.close()
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

    def generate(self, reqs: list[GenRequest], should_abort: Callable[[], bool] | None = None,
                 take_flip: Callable[[], FlipAt | None] | None = None) -> list[GenResult]:
        """Run one batch to completion (collective).

        Args:
            reqs: the batch (same list on every rank).
            should_abort: polled on rank 0 before each step; True stops the batch, active rows
                finish with reason ``abort``.
            take_flip: polled on rank 0 after each step that the batch goes on from; a
                :class:`FlipAt` publishes the session's copy on every rank before the next
                forward step (module docstring).

        Returns:
            One :class:`GenResult` per request on rank 0 (other ranks: results without tokens).

        Raises:
            ValueError: a request has stop strings and this rank has no :attr:`decode`.
        """
        if self.rank == 0 and self.decode is None and any(r.sampling.stop_strs or r.sampling.stop_regex for r in reqs):
            raise ValueError("stop strings need a tokenizer: set Engine.decode")
        dev = self.store.device
        prompts = [list(r.input_ids) for r in reqs]
        lens = torch.tensor([len(p) for p in prompts])
        total = max(len(p) + self._remaining(r) for p, r in zip(prompts, reqs))
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
                    self._prompt_logprobs(r, results[b], full[b, : len(prompts[b])])
        else:
            last = self.model.logits(hidden[rows, lens.to(dev) - 1])
        self._decode(reqs, results, lens.clone(), total, cache, last, should_abort, take_flip)
        return results

    @staticmethod
    def _remaining(req: GenRequest) -> int:
        return req.sampling.max_new_tokens - len(req.prior_output_ids)

    def _prompt_logprobs(self, req: GenRequest, res: GenResult, logits: torch.Tensor) -> None:
        """Prompt logprobs from ``logprob_start_len`` on (and their alternatives when asked)."""
        prompt = list(req.input_ids)
        start = req.logprob_start_len
        res.input_logprobs = prompt_logprobs(logits, prompt)[start:]
        if not (req.top_logprobs_num or req.token_ids_logprob):
            return
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        # position i is predicted from position i - 1; the first prompt token has no distribution
        dists: list[torch.Tensor | None] = [None, *logp[:-1]]
        if req.top_logprobs_num:
            res.input_top_logprobs = [None if d is None else _top(d, req.top_logprobs_num) for d in dists[start:]]
        if req.token_ids_logprob:
            res.input_token_ids_logprobs = [
                None if d is None else _picked(d, req.token_ids_logprob) for d in dists[start:]
            ]

    def _decode(
        self,
        reqs: list[GenRequest],
        results: list[GenResult],
        cur: torch.Tensor,
        total: int,
        cache: list[dict[str, torch.Tensor]],
        logits: torch.Tensor,
        should_abort: Callable[[], bool] | None,
        take_flip: Callable[[], FlipAt | None] | None = None,
    ) -> None:
        """Sample/feed steps until every row stops; ``cur[b]`` is row b's next position.

        Each step rank 0 broadcasts ``[token per row, advance per row, flip, continue]``: rows that
        got a token feed it at their next position and advance; stopped rows feed a dummy token
        at a clamped position (their cache is no longer read); with ``flip`` set every rank
        publishes the session's copy before that forward step.
        """
        dev = self.store.device
        num = len(reqs)
        gens: list[torch.Generator] = []  # rank 0's, seeded inside the step's error handling
        done = [self._remaining(r) <= 0 for r in reqs]
        for b in range(num):
            if done[b]:
                results[b].finish_reason = {"type": "length", "length": reqs[b].sampling.max_new_tokens}
        while True:
            ctrl = torch.zeros(2 * num + 2, dtype=torch.int64)
            failure: Exception | None = None
            flip: FlipAt | None = None
            if self.rank == 0:
                try:
                    gens = gens or self._generators(reqs)
                    self._step(reqs, results, done, logits, gens, should_abort, ctrl)
                    flip = self._take_flip(take_flip, results, done, ctrl)
                except Exception as exc:  # every rank must leave the batch: broadcast the fault first
                    failure = exc
                    ctrl.zero_()
                    ctrl[-1] = FAULT
            ctrl = self.groups.broadcast_tokens(ctrl.to(dev))
            flag = int(ctrl[-1])
            if flag == FAULT:
                if failure is not None:
                    raise StepError(f"sampling failed ({type(failure).__name__}: {failure}); the batch of "
                                    f"{num} request(s) ended on every rank") from failure
                return
            if not flag:
                return
            if int(ctrl[-2]):
                published = self.publish()
                if flip is not None:
                    flip.done(published)
            tokens, advance = ctrl[:num], ctrl[num : 2 * num].bool()
            pos = torch.where(advance, cur.to(dev), torch.clamp(cur.to(dev), max=total - 1))
            hidden = self.model.hidden(tokens[:, None], pos[:, None], cache)
            cur = cur + advance.cpu().to(cur.dtype)
            logits = self.model.logits(hidden[:, 0])

    @staticmethod
    def _take_flip(take_flip: Callable[[], FlipAt | None] | None, results: list[GenResult], done: list[bool],
                   ctrl: torch.Tensor) -> FlipAt | None:
        """Rank 0, after sampling a step the batch goes on from: a pending flip, set in ``ctrl`` and
        recorded in the spans of the rows that go on (their next token is the new version's)."""
        flip = take_flip() if take_flip is not None and ctrl[-1] == 1 else None
        if flip is not None:
            ctrl[-2] = 1
            for res, finished in zip(results, done, strict=True):
                if not finished:
                    res.version_spans.append((len(res.output_ids), flip.version))
        return flip

    def _generators(self, reqs: list[GenRequest]) -> list[torch.Generator]:
        """Rank 0: one generator per request, of its ``sampling_seed`` (a resumed request continues
        from its own seed and progress) or drawn from the engine's generator."""
        return [
            torch.Generator().manual_seed(
                generator_seed(r.sampling.sampling_seed, len(r.prior_output_ids))
                if r.sampling.sampling_seed is not None
                else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            )
            for r in reqs
        ]

    def _stop_ids(self, req: GenRequest) -> set[int]:
        return set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else set(self.eos_token_ids))

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
                results[b].finish_reason = {"type": "abort", "message": "Aborted"}
            return
        histories = [[*reqs[b].prior_output_ids, *results[b].output_ids] for b in active]
        tokens, logps, dists, errors = sample_tokens(
            logits[active],
            [reqs[b].sampling for b in active],
            [gens[b] for b in active],
            histories=histories,
            stop_ids=[sorted(self._stop_ids(reqs[b])) for b in active],
        )
        for k, b in enumerate(active):
            if errors[k] is not None:
                done[b] = True
                results[b].finish_reason = {"type": "abort", "message": errors[k], "status_code": 500}
                continue
            self._append(reqs[b], results[b], int(tokens[k]), float(logps[k]), dists[k])
            done[b] = results[b].finish_reason is not None
            ctrl[b] = tokens[k]
            ctrl[num + b] = 1
        ctrl[-1] = int(not all(done))

    def _append(self, req: GenRequest, res: GenResult, tok: int, logp: float, dist: torch.Tensor) -> None:
        """Record a row's new token; set its finish reason when it stops."""
        res.output_ids.append(tok)
        if req.return_logprob:
            res.output_logprobs.append(logp)
            if req.top_logprobs_num:
                res.output_top_logprobs.append(_top(dist, req.top_logprobs_num))
            if req.token_ids_logprob:
                res.output_token_ids_logprobs.append(_picked(dist, req.token_ids_logprob))
        sp = req.sampling
        generated = len(req.prior_output_ids) + len(res.output_ids)
        if generated < sp.min_new_tokens:  # stop tokens were masked; stop strings wait too
            return
        if tok in self._stop_ids(req):
            res.finish_reason = {"type": "stop", "matched": tok}
            return
        if sp.stop_strs or sp.stop_regex:
            assert self.decode is not None
            matched = match_stop(self.decode([*req.prior_output_ids, *res.output_ids]), sp.stop_strs, sp.stop_regex)
            if matched is not None:
                res.finish_reason = {"type": "stop", "matched": matched}
                return
        if generated >= sp.max_new_tokens:
            res.finish_reason = {"type": "length", "length": sp.max_new_tokens}


def _top(dist: torch.Tensor, n: int) -> TopLogprobs:
    values, ids = dist.topk(min(n, dist.numel()))
    return list(zip(values.tolist(), ids.tolist()))


def _picked(dist: torch.Tensor, ids: tuple[int, ...]) -> TopLogprobs:
    return [(float(dist[i]), i) for i in ids]

