"""The run loop: engines generate, the trainer steps, the weights move, the engines are checked.

One :class:`RunSession` per ``run``. Its top level reads as the loop it is::

    start()                      engines + trainer ranks, layout checks, the trainers' updaters
    initial_update()             step 0: check-weight-update-equal (unless SKIP_VALIDATION=1)
    for each step: generate() -> train() -> update() -> validate()
    finish()                     table, results.json, plot

Every update is the library's: each trainer rank holds a
:class:`~weightsync.sync.updater.WeightUpdater`, and :meth:`RunSession.update` asks all of them
for one update (rank 0 drives the engines): pause-free where the engines hold a shadow copy,
paused elsewhere. Each step records what the engines waited for (``engine_idle_s``: paused, from
``pause_generation`` to the return of ``continue_generation``; pause-free, the flip) beside the
whole update (``update_s``) and its phases: pause, begin, pack, wire, barrier, post_load, verify,
publish, resume (pack and wire are the slowest trainer rank's).

Trainer: ``synthetic`` (the CPU default; learns nothing) or ``megatron`` (the CUDA default:
megatron-core GRPO on the engines' rollouts, groups of ``group_size`` samples per prompt).
Placement: ``split`` (trainer and engine ranks on their own GPUs) or ``colocated`` (trainer rank
i and engine rank i share GPU i; broadcast then hands full tensors over through
``/update_weights_from_tensor``, as NCCL cannot put two ranks of a group on one GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from weightsync.engine.config import option_flags
from weightsync.launch.config import RunConfig
from weightsync.launch.messages import Export, Memory, Refresh, SetupUpdater, TrainStep, Update
from weightsync.launch.placement import EngineEndpoint, LocalPlacement, Placement
from weightsync.launch.procs import TrainerError, serve_argv
from weightsync.launch.replace import EngineReplacer, ReplaceError
from weightsync.launch.report import (
    error_summary,
    plot_phases,
    step_line,
    step_table,
    summary,
    summary_text,
    train_table,
    write_results,
)
from weightsync.launch.trainer_worker import SYNTHETIC_LABEL, WorkerConfig
from weightsync.launch.validate import (
    PARITY_PROMPTS,
    as_engine_holds,
    compare_ok,
    compare_snapshot,
    engine_checksum_mismatches,
    expected_checksums,
    holds_fp8_weights,
    max_abs_diff,
)
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.layout.sglang_fp8 import serving_fp8_block
from weightsync.layout.sglang_options import check_server_args
from weightsync.models.resolve import describe_model, model_spec, profile_fp8_block
from weightsync.models.spec import ModelSpec
from weightsync.plan.inputs import build_inputs
from weightsync.plan.records import Mode
from weightsync.sync.engine_client import EngineClient, EngineError
from weightsync.sync.engines import Engines, begin_recovering
from weightsync.sync.updater_config import UpdaterConfig
from weightsync.transport import TransportConfig

log = logging.getLogger(__name__)

LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
"""Max |engine - reference| of prompt logprobs, per model dtype (TP reductions reorder sums)."""


COMPUTE_DTYPE_ARGS = ("--compute-dtype", "float32")
"""Engines of a run compute in float32 (weights stay in their own dtype): the logprob-parity gate
compares with a float32 reference forward, and bf16 activations on CUDA flip near-tied MoE
routing choices (measured on H200: |d| up to 0.25 with bf16, ~1e-5 with float32), which would
hide or fake a weight error. It does not change a byte that the update moves."""


class RunError(RuntimeError):
    """The run stopped; the message says why (before any byte is written when it can)."""


class RunSession:
    """One run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, hf_dir: Path, torch_dist_dir: Path, placement: Placement | None = None
                 ) -> None:
        """``placement``: where the processes start (default: all on this host, :class:`LocalPlacement`)."""
        self.cfg = cfg
        # The checkpoint's own architecture and shapes (a synthetic one's config.json is the registry's),
        # and the fp8 block the engines serve (the checkpoint's, or the profile's where a shard cuts it).
        self.spec = self._served(model_spec(cfg.model, cfg.scale, checkpoint=hf_dir, dtype=cfg.dtype))
        self.hf_dir = hf_dir
        self.torch_dist_dir = torch_dist_dir
        self.procs = placement if placement is not None else LocalPlacement(cfg.log_dir, cfg.node_plan, host=cfg.host,
                                                                            token=cfg.env.token)
        self.procs.deadlines = cfg.deadlines
        self._gen_clients: list[EngineClient] = []
        self.inputs = build_inputs(self.spec, cfg.train, cfg.rollout, trainer_layout=trainer_layout,
                                   engine_layout=engine_layout)
        self.steps: list[dict[str, Any]] = []
        self.version = 0
        self._initial: dict[str, Any] | None = None
        self._engine_weights: list[str] = []
        self._infos: dict[int, dict[str, Any]] | None = None
        self._memory: dict[str, Any] = {}
        self._verified = False
        self._exported = cfg.log_dir / "trainer_weights"
        self._replacer = (EngineReplacer(self.procs, timeout_s=cfg.deadlines.engine_start_s)
                          if cfg.replace_dead_engines else None)
        self._during: list[dict[str, Any]] = []  # this step's engines replaced during its generate/validate

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Everything, with teardown on any exit; returns the summary."""
        try:
            self.start()
            self.steps.append(self.initial_update())
            self._print_step(self.steps[-1])
            for step in range(1, self.cfg.num_steps + 1):
                replaced = self.replace_dead(step, "generate")
                samples = self.generate(step)  # one that dies generating is replaced, its chunk resent
                trained = self.train(samples)
                replaced += self.replace_dead(step, "update")
                record = self.update(step)
                replaced += self.replace_dead(step, "validate")  # one that died in the update joins it
                record["train"] = trained
                record.update(self.validate(step))
                if self._replacer is not None:
                    record["replacements"], self._during = replaced + self._during, []
                self.steps.append(record)
                self._print_step(record)
            return self.finish()
        except ReplaceError as exc:  # names the dead engine and what its replacement did
            raise RunError(f"{exc}\n(the run stopped at step {len(self.steps)})") from exc
        except (RunError, EngineError, TrainerError) as exc:
            causes = self.procs.diagnose_engines()
            if not causes:
                raise
            # an engine died, hung or faulted: that is the cause, what its callers saw follows from it
            first = error_summary(str(exc)).splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = first if len(first) <= 300 else first[:297] + "..."
            raise RunError("\n".join(causes) + f"\n(the run stopped at step {len(self.steps)}: {first})") from exc
        finally:
            # the trainer ranks' updaters take the run's weight-update groups off the engines as
            # they stop (engines this run did not start keep serving)
            for c in self._gen_clients:
                c.close()
            self.procs.close()

    def _transport(self) -> TransportConfig:
        """``--transport`` resolved by the written policy over this run's placement: every trainer
        and engine rank is a process of its own, on the node the placement puts it on."""
        cfg = self.cfg
        return TransportConfig.resolve(cfg.transport, self.procs.nodes.pairs(), on_gpu=cfg.device == "cuda",
                                       **cfg.env.transport_options)

    def start(self) -> None:
        cfg = self.cfg
        r = cfg.rollout
        transport = self._transport()

        def argv(ep: EngineEndpoint) -> list[str]:
            return serve_argv(model=cfg.model, scale=cfg.scale, tp=r.tp, ep=r.ep, dp=r.dp, device=cfg.device,
                              port=ep.port, checkpoint=None if cfg.env.skip_validation else self.hf_dir,
                              transport=transport, host=ep.host, moe_dense_tp=r.moe_dense_tp, dp_lm_head=r.dp_lm_head,
                              options=option_flags(r),
                              # dummy weights of the checkpoint's shapes when the equality check is skipped
                              extra=[*COMPUTE_DTYPE_ARGS, "--dtype", cfg.dtype,
                                     *(["--checkpoint", str(self.hf_dir)] if cfg.env.skip_validation else [])])

        if cfg.engine_urls:
            print(f"using {r.num_engines} running engine(s); starting {cfg.train.world_size} trainer rank(s) ...",
                  flush=True)
        else:
            print(f"starting {r.num_engines} engine(s) of {r.tp} rank(s) and {cfg.train.world_size} trainer rank(s) "
                  "...", flush=True)
        wcfg = WorkerConfig(model=cfg.model, scale=cfg.scale, spec=self.spec, train=cfg.train, rollout=cfg.rollout,
                            ckpt_dir=str(self.torch_dist_dir), master_addr=self.procs.trainer_host(0),
                            master_port=self.procs.trainer_port(0), device=cfg.device, seed=cfg.seed,
                            trainer=cfg.trainer, gpus=self._trainer_gpus(),
                            lr=cfg.lr, group_size=cfg.group_size,
                            synthetic_weights=_is_synthetic(self.hf_dir),
                            collective_timeout_s=cfg.deadlines.collective_s, fault_hook=cfg.env.fault_hook)
        if cfg.engine_urls:
            self.procs.attach_engines(cfg.engine_urls)
            self.check_engines()  # before any trainer rank exists: nothing to undo on a mismatch
            self.procs.spawn_trainers(wcfg)
        else:
            self.procs.spawn_trainers(wcfg)  # they load their shards while the engines start
            self.procs.start_engines(argv, timeout_s=cfg.deadlines.engine_start_s)
            self.check_engines()
        self.procs.wait_trainers(timeout_s=cfg.deadlines.trainer_start_s)
        # generation requests take longer than a control call: clients of their own
        self._gen_clients = [EngineClient(e.url, timeout_s=cfg.deadlines.generate_s, token=self.procs.token)
                             for e in self.procs.engines]
        self.setup_updater()

    def _trainer_gpus(self) -> tuple[int, ...]:
        """CUDA: trainer rank i on GPU i when colocated (engine rank i is there too: ``serve``
        puts rank r on cuda:r); split: the trainer's default, from the last GPU down."""
        if self.cfg.device != "cuda" or self.cfg.placement != "colocated":
            return ()
        return tuple(range(self.cfg.train.world_size))

    def check_engines(self) -> None:
        """Refuse engines that serve another model or layout, before any byte is written.

        Only what sglang itself publishes is read, so a real sglang server is checked the same way:
        ``/server_info``'s ``ServerArgs`` sizes (tp, dp, ep, pp, moe-dense-tp, dp-lm-head); the
        destination layout derived from the model's ``config.json`` at the engine's ``model_path``
        (when this host can read it) against the plan's; and, for p2p, every rank's
        ``/parallelism_config`` and published parameter table (each ``(numel, element_size)``
        against the plan, kept for :meth:`setup_p2p`).
        """
        r = self.cfg.rollout
        want = {"tp_size": r.tp, "dp_size": r.dp, "ep_size": r.ep, "pp_size": 1, "moe_dense_tp_size": r.moe_dense_tp,
                "enable_dp_lm_head": r.dp_lm_head}
        infos = self.procs.on_engines(lambda c: c.server_info())
        for i, info in enumerate(infos):
            sizes = [f"{k}={info.get(k)!r} (this run needs {v!r})" for k, v in want.items() if info.get(k) != v]
            try:
                check_server_args(info)
            except ValueError as exc:
                sizes.append(str(exc))
            problems = self._model_problems(info, layouts=not sizes) + sizes
            if problems:
                raise RunError(f"engine {i} at {self.procs.engines[i].url} does not match this run: "
                               + ", ".join(problems))
        self._engine_weights = [
            f"dummy:{i.get('served_model_name')}" if i.get("load_format") == "dummy" else str(i.get("model_path"))
            for i in infos
        ]
        if Mode.P2P in self.cfg.modes:
            self._infos = self._transfer_infos()

    def _served(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` with the fp8 block an engine of this run serves (as ``weightsync serve`` decides it)."""
        return serving_fp8_block(spec, self.cfg.rollout, profile_fp8_block(self.cfg.model, self.cfg.scale))

    def _model_problems(self, info: dict[str, Any], *, layouts: bool) -> list[str]:
        """Why the engine's model (its ``config.json``) is not this run's, or how the destination
        layout derived from it differs from the plan's (with ``layouts``: the sizes matched); []
        when neither, or when this host cannot read the file (the parameter table is checked then)."""
        from weightsync.models.resolve import CONFIG_FILE, model_spec

        path = info.get("model_path")
        if not path or not (Path(str(path)) / CONFIG_FILE).is_file():
            log.warning("cannot read the engine's model config (%s/%s) here: its model is checked by the parameters "
                        "it publishes only", path, CONFIG_FILE)
            return []
        try:
            spec = self._served(model_spec(self.cfg.model, self.cfg.scale, checkpoint=str(path), dtype=self.spec.dtype))
        except ValueError as exc:
            return [f"its model {path}: {exc}"]
        out: list[str] = []
        for rank in range(self.cfg.rollout.tp if layouts else 0):
            theirs = {t.name: (t.shape, t.dtype) for t in engine_layout(spec, self.cfg.rollout, rank)}
            ours = {t.name: (t.shape, t.dtype) for t in self.inputs.dest_layout(rank)}
            out += [f"rank {rank} {n}: engine {theirs.get(n)}, plan {ours.get(n)}"
                    for n in sorted(set(theirs) | set(ours)) if theirs.get(n) != ours.get(n)]
        if out:
            return [f"the layout of its model ({path}) differs from the plan's in {len(out)} tensors, e.g. "
                    + "; ".join(out[:3])]
        return []

    def _transfer_infos(self) -> dict[int, dict[str, Any]]:
        """Every rollout rank's published parameter table (and transport descriptor, an extension of
        this project's engine), by global rollout rank, after its ``/parallelism_config`` and
        table were checked against the plan (the library's discovery, which the trainer ranks'
        updaters run again)."""
        engines = Engines([e.client for e in self.procs.engines])
        try:
            return engines.transfer_infos(self.cfg.rollout, self.inputs.dest_layout, self._transport().kind.value)
        except ValueError as exc:
            raise RunError(str(exc)) from None

    def _updater_config(self) -> UpdaterConfig:
        """How the trainer ranks update: the run's mode, bucket size and transport; colocated
        broadcast through ``/update_weights_from_tensor``; every update verified by fingerprints."""
        from weightsync.plan.broadcast import stage_sources

        host = self.procs.trainer_host(0)
        if Mode.BROADCAST in self.cfg.modes and self.cfg.placement != "colocated":
            sources = sorted(set(stage_sources(self.inputs).values()))
            hosts = {self.procs.trainer_host(s) for s in sources}
            if len(hosts) > 1:
                raise RunError(f"broadcast: the stage sources {sources} run on several hosts {sorted(hosts)}; the "
                               "weight-update groups take one rendezvous address (master_address), so broadcast "
                               "needs them on one host here: use p2p, or a layout whose pipeline stages' first ranks "
                               "share a node")
            host = hosts.pop()
        d = self.cfg.deadlines
        return UpdaterConfig(mode=self.cfg.mode, bucket_bytes=self.cfg.bucket_bytes, transport=self._transport(),
                             colocated=self.cfg.placement == "colocated", verify_every=1, master_address=host,
                             deadline_s=d.write_s, http_timeout_s=d.engine_call_s, group_timeout_s=d.group_s,
                             update_retries=self.cfg.update_retries, pause_free=self.cfg.pause_free,
                             flip=self.cfg.flip, token=self.procs.token,
                             # a replaced engine rejoins between updates: one failing in an update is dropped
                             on_engine_failure="drop" if self.cfg.replace_dead_engines else "auto")

    def setup_updater(self) -> None:
        """Every trainer rank builds its :class:`~weightsync.sync.updater.WeightUpdater` (plan
        share, connections, registration, checks); then what each side holds is printed."""
        res = self.procs.command(SetupUpdater(engine_urls=tuple(e.url for e in self.procs.engines),
                                              config=self._updater_config()))
        if Mode.P2P in self.cfg.modes:
            print(f"p2p plan: {sum(x.ops for x in res)} ops over {len(res)} trainer ranks, "
                  f"{sum(x.bytes for x in res) / 1e6:.1f} MB per update, planned in "
                  f"{max(x.plan_s for x in res):.2f} s", flush=True)
        self._memory = {"engine_params_per_rank": self._engine_param_bytes(),
                        "trainer_ranks": [x.memory for x in res]}
        print(_memory_line(self._memory, "at set-up"), flush=True)

    def _engine_param_bytes(self) -> list[int]:
        """Bytes of every engine rank's parameter block (its layout, as the engine allocates it)."""
        from weightsync.sync.params import ParamStore

        return [ParamStore.required_bytes(list(self.inputs.dest_layout(r))) for r in range(self.cfg.rollout.tp)]

    # -- steps ----------------------------------------------------------------------------------
    def replace_dead(self, step: int, before: str) -> list[dict[str, Any]]:
        """``--replace-dead-engines``: every engine this run started that died is started again and
        joins the current version from a healthy peer (:mod:`~weightsync.launch.replace`); then
        the trainer ranks' updaters re-read the engines. Returns the replacements (none without
        the option)."""
        if self._replacer is None:
            return []
        done = self._replacer.replace_dead(step, str(self.version), before)
        self._rejoined(done)
        return done

    def _rejoined(self, done: list[dict[str, Any]]) -> None:
        """After replacements: new generation clients, every trainer rank re-reads the engines."""
        if done:
            for r in done:
                self._gen_clients[r["engine"]].close()
                self._gen_clients[r["engine"]] = EngineClient(self.procs.engines[r["engine"]].url,
                                                              timeout_s=self.cfg.deadlines.generate_s,
                                                              token=self.procs.token)
            self.procs.command(Refresh())
            if Mode.P2P in self.cfg.modes:  # the replacements' sessions, for results.json
                self._infos = self._transfer_infos()

    def _on_engines(self, step: int, what: str, call: Callable[[int], Any]) -> list[Any]:
        """``call(i)`` on every engine at once (one that dies in it: :meth:`EngineReplacer.call_each`)."""
        if self._replacer is None:
            return [f.result() for f in [self.procs.submit(call, i) for i in range(len(self.procs.engines))]]
        outs, done = self._replacer.call_each(step, str(self.version), what, call, self._rejoined)
        self._during += done
        return outs

    def generate(self, step: int) -> list[dict[str, Any]]:
        """Every engine generates for a batch of prompts, each prompt ``group_size`` times (the
        groups GRPO normalises over); returns the samples (prompt and output tokens, text, the
        engine's logprob of each output token, the prompt's answer)."""
        from weightsync.data import load_prompts

        per_engine = self.cfg.prompts_per_step
        group = self.cfg.group_size if self.cfg.trainer == "megatron" else 1
        prompts = load_prompts(per_engine * self.cfg.rollout.num_engines, offset=step)
        chunks = [[p for p in prompts[i * per_engine:(i + 1) * per_engine] for _ in range(group)]
                  for i in range(self.cfg.rollout.num_engines)]
        bodies = [
            {"text": [p["prompt"] for p in chunk],
             "sampling_params": {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 1.0, "top_p": 1.0},
             "return_logprob": True, "return_prompt_token_ids": True}
            for chunk in chunks
        ]
        outs = self._on_engines(step, "generate", lambda i: self._gen_clients[i].generate(bodies[i]))
        samples: list[dict[str, Any]] = []
        for out, chunk in zip(outs, chunks, strict=True):
            for o, p in zip(out, chunk, strict=True):
                if o["meta_info"]["weight_version"] != str(self.version):
                    raise RunError(f"an engine answered with weight version {o['meta_info']['weight_version']}, "
                                   f"expected {self.version}")
                samples.append({"prompt": p["prompt"], "answer": p.get("answer", ""),
                                "prompt_ids": o.get("prompt_token_ids", []), "output_ids": o["output_ids"],
                                "text": o["text"],
                                "rollout_logprobs": [row[0] for row in o["meta_info"]["output_token_logprobs"]]})
        return samples

    def train(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """One step of every trainer rank; rank 0's stats (megatron: loss, reward, grad norm, the
        train/rollout logprob difference; synthetic: the step). With megatron the trainer's
        weights are then written out for the validation's reference."""
        out = self.procs.command(TrainStep(samples=tuple(samples)))[0]
        if self.cfg.trainer == "megatron":
            self.procs.command(Export(directory=str(self._exported)))
        return out.to_json()

    def update(self, step: int) -> dict[str, Any]:
        """Move the weights into every engine (the trainer ranks' updaters); the timed section."""
        mode = self.cfg.modes[step % len(self.cfg.modes)]
        stats = self.procs.command(Update(version=step, mode=mode))[0]
        self.version = step
        self._verified = bool(stats.verified)
        return {
            "step": step, "mode": mode, "path": stats.path, "pause_free": stats.pause_free, "flip": stats.flip,
            "pause_reason": stats.pause_reason, "engine_idle_s": stats.engine_idle_s,
            "idle_phases": dict(stats.idle_phases), "update_s": stats.update_s, "phases": dict(stats.phases),
            "write_s": stats.write_s, "verify_s": stats.verify_s, "control_s": stats.control_s,
            "post_load_engine_s": stats.post_load_engine_s, "bytes": stats.bytes,
            "bytes_per_receiver": {str(k): v for k, v in sorted(stats.bytes_per_receiver.items())},
            "buckets": stats.buckets, "update_verified": stats.verified,
            "attempts": stats.attempts, "failed_attempts": list(stats.failed_attempts),
            **({"dropped": {str(k): v for k, v in sorted(stats.dropped.items())}} if stats.dropped else {}),
        }

    def initial_update(self) -> dict[str, Any]:
        """Step 0: the first update, with the trainer's initial weights.

        Unless ``SKIP_VALIDATION=1`` this is sglang's ``--check-weight-update-equal``: the engines'
        weights loaded from the checkpoint are snapshotted, reset to random values, updated, and
        compared bit for bit with the snapshot (:meth:`_snapshot_and_reset`; engines this run did
        not start load the checkpoint first).
        """
        validation: dict[str, str] = {}
        skip = self.cfg.env.skip_validation
        if not skip:
            unreadable = [why for why in self.procs.on_engines(self._snapshot_and_reset) if why]
            if unreadable:
                skip = True
                validation["check_weight_update_equal"] = "skipped: " + "; ".join(unreadable)[:500]
        record = self.update(0)
        if not skip:
            # A real fp8 checkpoint's weights come back re-quantized from the trainer's dequantized
            # copy: compared dequantized within one fp8 ULP per side, as sglang's checker does; the
            # MLA w_kc / w_vc derived from them then differ too and are left out, as sglang's checker
            # does not see them (they are no parameters there). The checksums below still compare
            # every tensor, derived ones included, with the trainer's weights bit for bit.
            allow = holds_fp8_weights(self.hf_dir)
            results = self.procs.on_engines(lambda c: compare_snapshot(c, allow_quant_error=allow))
            bad = [f"engine {i}: {r}" for i, r in enumerate(results) if not compare_ok(r)]
            validation["check_weight_update_equal"] = "pass" if not bad else "fail: " + "; ".join(bad)[:500]
        elif not validation:
            validation["check_weight_update_equal"] = "skipped"
        checks = self.validate(0)
        if self._during:  # engines replaced during step 0's validation
            record["replacements"], self._during = self._during, []
        record["validation"] = {**validation, **checks.pop("validation")}
        record.update(checks)
        return record

    def _snapshot_and_reset(self, client: EngineClient) -> str:
        """Step 0's check on one engine, before the update: pause it (live requests wait, retracted,
        instead of failing the reset with 409), snapshot what this run loads, reset. An engine this
        run did not start may hold another run's weights (a failed run left them): it loads this
        run's checkpoint first, in a session of its own (a stale one aborted) that publishes it --
        the snapshot reads the served copy, which a session on a shadow copy reaches only by its
        publication -- and the reset then makes it dirty. Returns why the check cannot run on it
        ("" when it can)."""
        client.pause_generation("retract")
        if self.cfg.engine_urls:
            begin_recovering(client)
            try:
                client.update_weights_from_disk(str(self.hf_dir.absolute()))
            except EngineError as exc:  # on another host the path is not there
                client.abort_weight_update()
                return f"{client.base_url} cannot load this run's checkpoint ({str(exc)[:200]})"
            client.end_weight_update()  # post-load: derived tensors too
            client.update_weight_version("checkpoint")  # served from here on (paused), then snapshotted
        client.weights_checker("snapshot")
        client.weights_checker("reset_tensors")
        return ""

    def _reference(self, step: int) -> Any:
        """The trainer's global tensors after ``step`` updates, independently of the transfer:
        synthetic, computed from the checkpoint (the synthetic trainer's rule is a function of
        global coordinates); megatron, the full tensors the stage sources wrote after the step
        (gathered over the trainer's process group, not by the update's plan), the checkpoint's
        at step 0."""
        from weightsync.sources.hf_source import read_global_tensors
        from weightsync.sources.synthetic import SyntheticUpdate, full_tensors_at_step

        if self._initial is None:  # in the trainer's dtype, fp8 weights dequantized with their scales
            self._initial = read_global_tensors(self.hf_dir, self.spec)
        if self.cfg.trainer == "megatron":
            if step == 0:
                return self._initial.__getitem__
            from safetensors.torch import load_file

            trained: dict[str, Any] = {}
            for f in sorted(self._exported.glob("*.safetensors")):
                trained.update(load_file(str(f)))
            return trained.__getitem__
        full = full_tensors_at_step(self._initial, self.spec, step, SyntheticUpdate(seed=self.cfg.seed))
        return full.__getitem__

    def validate(self, step: int) -> dict[str, Any]:
        """Checksums of every engine parameter against the trainer's weights, and logprob parity."""
        read = self._reference(step)
        want: dict[bool, list[dict[str, str]]] = {}  # sglang hashes GPU and CPU parameters differently
        bad: list[str] = []

        def check(e: int) -> tuple[bool, Any]:  # every rank's checksums, in sglang's answer shape
            client = self.procs.engines[e].client
            return (client.server_info().get("device") or self.cfg.device) != "cpu", client.weights_checker("checksum")

        for e, (gpu, answer) in enumerate(self._on_engines(step, "validate", check)):
            if gpu not in want:
                want[gpu] = [expected_checksums(self.spec, self.cfg.rollout, r, read, gpu=gpu)
                             for r in range(self.cfg.rollout.tp)]
            bad += [f"engine {e} {line}" for line in engine_checksum_mismatches(answer, want[gpu])]
        lp = self._logprob_parity(step, read)
        tol = LOGPROB_TOL.get(self.spec.dtype, 2e-2)
        out = {
            "checksums": "pass" if not bad else "fail: " + "; ".join(bad)[:500],
            "logprob_parity": "pass" if lp <= tol else f"fail: max |d| {lp:.3g} > {tol}",
            # the updater's own verification (a mismatch fails the update itself, engines paused)
            "update_checksums": "pass" if self._verified else "skipped",
        }
        return {"validation": out, "logprob_max_abs_diff": lp}

    def _logprob_parity(self, step: int, read: Any) -> float:
        from weightsync.engine.reference import reference_prompt_logprobs

        body = {"text": list(PARITY_PROMPTS), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": 0}
        outs = self._on_engines(step, "validate", lambda i: self._gen_clients[i].generate(body))
        held = as_engine_holds(self.spec, read, self.cfg.rollout)
        want = [reference_prompt_logprobs(self.spec, held, self.hf_dir, prompt) for prompt in PARITY_PROMPTS]
        worst = 0.0
        for out in outs:
            for o, w in zip(out, want, strict=True):
                got = [row[0] for row in o["meta_info"]["input_token_logprobs"]]
                worst = max(worst, max_abs_diff(got, w))
        return worst

    def finish(self) -> dict[str, Any]:
        from weightsync.sources.prepare import weights_label

        # the updaters' buffers that the first updates allocate (colocated broadcast, verification)
        self._memory["trainer_ranks"] = self.procs.command(Memory())
        print(_memory_line(self._memory, "after the updates"), flush=True)
        synthetic = _is_synthetic(self.hf_dir)
        meta = {"model": self.cfg.model, "scale": self.cfg.scale, "mode": self.cfg.mode, "device": self.cfg.device,
                "model_description": describe_model(self.spec, None if synthetic else self.hf_dir),
                "trainer": SYNTHETIC_LABEL if self.cfg.trainer == "synthetic" else "megatron (megatron-core GRPO)",
                "gpu_placement": self.cfg.placement, "memory_bytes": self._memory,
                "checkpoint": str(self.hf_dir), "weights": weights_label(self.hf_dir), "dtype": self.cfg.dtype,
                "train": asdict(self.cfg.train), "rollout": asdict(self.cfg.rollout),
                "transport": self._transport().kind.value,
                "bucket_bytes": self.cfg.bucket_bytes, "embedded_default": self.cfg.embedded_default,
                "dest_bytes_per_receiver": self._dest_bytes(), "engine_weights": self._engine_weights,
                "placement": {**self.procs.describe(),
                              "engine_sessions": [i["session_id"] for _, i in sorted((self._infos or {}).items())]}}
        path = write_results(self.cfg.log_dir, meta, self.steps)
        what = f"{self.cfg.model} ({self.cfg.scale})" if synthetic else f"{self.hf_dir.name} ({self.cfg.model} profile)"
        plot = plot_phases(self.cfg.log_dir, self.steps, f"{what} {self.cfg.mode}")
        print()
        print(step_table(self.steps))
        if self.cfg.trainer == "megatron":
            print()
            print(train_table(self.steps))
        s = summary(self.steps)
        print()
        print(summary_text(s))
        print(f"results: {path}" + (f", plot: {plot}" if plot else ""))
        return s

    def _dest_bytes(self) -> dict[str, int]:
        """Bytes of each rollout rank's shard that come from global tensors (what p2p must move)."""
        from weightsync.plan.api import shard_dest_bytes

        return {str(d): shard_dest_bytes(self.inputs.dest_layout(d)) for d in range(self.cfg.rollout.world_size)}

    def _print_step(self, record: dict[str, Any]) -> None:
        print(step_line(record), flush=True)


def _is_synthetic(hf_dir: Path) -> bool:
    """Whether the run's checkpoint holds synthetic weights (which never solve a math prompt)."""
    from weightsync.sources.prepare import weights_label

    return weights_label(hf_dir) == "synthetic"


def _memory_line(memory: dict[str, Any], when: str) -> str:
    """What each side holds, for the run's output (MB = 1e6 bytes)."""
    engine = memory["engine_params_per_rank"]
    parts = [f"engine parameters {sum(engine) / 1e6:.1f} MB per engine ({len(engine)} rank(s))"]
    for r, m in enumerate(memory["trainer_ranks"]):
        items = ", ".join(f"{k.removeprefix('trainer_')} {v / 1e6:.1f}"
                          for k, v in m.items() if not k.startswith("gpu_") and k != "updater_params")
        gpu = (f"; its GPU: {m['gpu_used_all_processes'] / 1e6:.0f} MB used by every process, "
               f"{m['gpu_allocated_this_rank'] / 1e6:.0f} MB allocated by this rank" if "gpu_used_all_processes" in m
               else "")
        parts.append(f"trainer rank {r} (MB): {items}{gpu}")
    return f"memory {when}: " + "; ".join(parts)


__all__ = ["EngineError", "RunError", "RunSession"]
