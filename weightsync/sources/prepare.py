"""``weightsync prepare MODEL``: the HF checkpoint, the trainer's torch_dist checkpoint and the
prompt data of a run, under one checkpoint directory.

Outputs, for ``<name>`` = ``MODEL`` at full scale, ``MODEL_tiny`` at tiny scale and
``MODEL_<N>layer`` at ``layers=N`` (the reference system's ``GLM-5_4layer`` style)::

    <ckpt>/<name>/               HF checkpoint: config.json + *.safetensors
    <ckpt>/<name>_torch_dist/    Megatron torch_dist checkpoint (weightsync.sources.torch_dist)
    <ckpt>/datasets/<prompts>.jsonl

``<ckpt>`` is ``--ckpt-dir``, else ``$CKPT_SAVE_DIR``, else ``/root/multinode`` (read by the
CLI entry point through :func:`weightsync.launch.config.env_settings`, the one place that
reads the environment).

The HF checkpoint is ``--hf-checkpoint DIR`` when given (checked against the model first, then
copied, or used in place when it already is ``<ckpt>/<name>``), an HF checkpoint already at
``<ckpt>/<name>`` (e.g. downloaded there), or else a SYNTHETIC one: seeded random-init weights
with the model's real config and tensor layout (no model hub is reachable from these machines;
the loading code is the same). The torch_dist shards are those of ``PrepareConfig.train`` (the
command's ``--train``, over the run profile: :func:`weightsync.models.fit.profile_sizes`; default:
the model's run profile when it fits the scale, else a small configuration, see
:func:`default_train`).

Every step is idempotent and atomic (:mod:`weightsync.sources.output_dir`): a complete output
for the same request is skipped, an interrupted one is redone, and bad input (a checkpoint that
is not the model, a parallel configuration that does not divide) is refused before anything is
written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.models import get_model, parse_scale
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec

FORMAT_VERSION = 1
"""Bumped when the layout of an output changes (older outputs are then redone)."""
BUNDLED_PROMPTS_NAME = "weightsync-math"
SYNTHETIC_LIMIT_BYTES = 32 << 30
"""Largest synthetic HF checkpoint ``prepare`` builds (it is generated in memory)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPaths:
    """Where ``prepare`` puts (and ``run`` finds) a model's files."""

    root: Path
    hf: Path
    torch_dist: Path
    datasets: Path


def output_name(model: str, scale: str) -> str:
    """``MODEL``, ``MODEL_tiny`` or ``MODEL_<N>layer`` for scale full, tiny, ``layers=N``."""
    kind, n = parse_scale(scale)
    return {"full": model, "tiny": f"{model}_tiny"}.get(kind, f"{model}_{n}layer")


def checkpoint_paths(ckpt_dir: str | Path, model: str, scale: str) -> CheckpointPaths:
    """The output paths of ``model`` at ``scale`` under ``ckpt_dir``."""
    root = Path(ckpt_dir)
    name = output_name(model, scale)
    return CheckpointPaths(root=root, hf=root / name, torch_dist=root / f"{name}_torch_dist",
                           datasets=root / "datasets")


def _profile_mla_rep(model: str) -> bool:
    """The run profile's ``mla_down_proj_replicated`` (False for a model without one)."""
    from weightsync.models import get_profile

    try:
        return get_profile(model).train.mla_down_proj_replicated
    except ValueError:
        return False


def default_train(spec: ModelSpec) -> TrainParallel:
    """The parallel configuration of the torch_dist shards when none is given.

    The model's run profile (``weightsync list``) when it fits ``spec`` at its scale; otherwise
    TP 2 (and EP 2 for MoE) on 2 ranks, or a single rank when even that does not divide.
    ``mla_down_proj_replicated`` is the profile's either way.
    """
    from weightsync.layout.megatron import check_trainer_config
    from weightsync.models import get_profile

    candidates = []
    with contextlib.suppress(ValueError):  # a model without a run profile
        candidates.append(get_profile(spec.name).train)
    rep = _profile_mla_rep(spec.name)
    candidates += [TrainParallel(world_size=2, tp=2, ep=2 if spec.is_moe else 1, mla_down_proj_replicated=rep),
                   TrainParallel(world_size=1, mla_down_proj_replicated=rep)]
    for par in candidates:
        try:
            check_trainer_config(spec, par)
        except ValueError:
            continue
        return par
    raise AssertionError("a single rank always fits")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareConfig:
    """One ``prepare``."""

    model: str
    scale: str = "full"
    ckpt_dir: Path
    hf_checkpoint: Path | None = None
    """An existing HF safetensors directory to use instead of a synthetic checkpoint."""
    download_only: bool = False
    """Only the HF checkpoint and the prompt data (no torch_dist conversion)."""
    prompt_data: Path | None = None
    """A prompt file (.jsonl) instead of the bundled math prompts."""
    train: TrainParallel | None = None
    """Parallel configuration of the torch_dist shards (None: :func:`default_train`)."""
    seed: int = 0
    """Seed of a synthetic HF checkpoint."""
    progress: bool = True
    """Show progress bars (stderr)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareResult:
    """What ``prepare`` produced (or found complete)."""

    paths: CheckpointPaths
    synthetic: bool
    """The HF checkpoint holds synthetic (random-init) weights."""
    train: TrainParallel | None
    prompts: Path
    actions: dict[str, str]
    """``hf`` / ``torch_dist`` / ``prompts`` -> what was done (``written``, ``skipped (complete)``, ...)."""


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _spec_fingerprint(spec: ModelSpec) -> str:
    d = dataclasses.asdict(spec)
    d.pop("sources", None)
    return _fingerprint(d)


def _dir_fingerprint(path: Path) -> str:
    """Names, sizes and modification times of a directory's files (a foreign HF checkpoint)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return _fingerprint(files)


class _Bar:
    """A byte progress bar (tqdm on stderr), or nothing."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def prepare(cfg: PrepareConfig, *, say: Callable[[str], None] = print) -> PrepareResult:
    """Produce the HF checkpoint, the torch_dist checkpoint and the prompt data of ``cfg``.

    Args:
        cfg: what to prepare.
        say: where progress lines go.

    Returns:
        A :class:`PrepareResult`.

    Raises:
        ValueError: unknown model or scale, an HF checkpoint that is not the model (naming each
            mismatch), a parallel configuration that does not fit the model, a bad prompt
            file, or a synthetic checkpoint too large to build. Nothing is written then.
        FileExistsError: an output path holds something weightsync did not write and cannot use.
    """
    from weightsync.layout.megatron import check_trainer_config

    spec = get_model(cfg.model, cfg.scale)
    paths = checkpoint_paths(cfg.ckpt_dir, cfg.model, cfg.scale)
    train = None if cfg.download_only else (cfg.train or default_train(spec))
    if train is not None:
        check_trainer_config(spec, train)
    prompts = _load_prompt_records(cfg.prompt_data)
    hf_source = _resolve_hf_source(cfg, spec, paths)  # validates a given checkpoint before writing
    actions: dict[str, str] = {}
    synthetic, hf_identity, actions["hf"] = _prepare_hf(cfg, spec, paths, hf_source, say)
    if train is not None:
        actions["torch_dist"] = _prepare_torch_dist(cfg, spec, paths, train, hf_identity, say)
    prompt_file, actions["prompts"] = _write_prompts(paths, cfg.prompt_data, prompts)
    say(f"prompts: {prompt_file} ({len(prompts)} prompts) -- {actions['prompts']}")
    return PrepareResult(paths=paths, synthetic=synthetic, train=train, prompts=prompt_file, actions=actions)


def ensure_prepared(model: str, *, scale: str, ckpt_dir: str | Path, train: TrainParallel | None = None,
                    seed: int = 0, progress: bool = True) -> tuple[Path, Path]:
    """``prepare`` for a run (synthetic HF checkpoint unless one is in place); returns the
    ``(hf_dir, torch_dist_dir)`` the run loads."""
    result = prepare(PrepareConfig(model=model, scale=scale, ckpt_dir=Path(ckpt_dir), train=train, seed=seed,
                                   progress=progress))
    return result.paths.hf, result.paths.torch_dist


# --------------------------------------------------------------------------- HF checkpoint


def _resolve_hf_source(cfg: PrepareConfig, spec: ModelSpec, paths: CheckpointPaths) -> Path | None:
    """The HF directory to use (checked against the model), or None for a synthetic one."""
    from weightsync.sources.hf_source import check_hf_checkpoint, synthetic_bytes
    from weightsync.sources.output_dir import read_marker

    if cfg.hf_checkpoint is not None:
        check_hf_checkpoint(cfg.hf_checkpoint, spec)
        return Path(cfg.hf_checkpoint).resolve()
    if paths.hf.exists() and read_marker(paths.hf) is None:
        try:
            check_hf_checkpoint(paths.hf, spec)
        except ValueError as exc:
            raise FileExistsError(f"{paths.hf} exists, was not written by weightsync and is not usable: {exc}. "
                                  f"Move it away, pass --hf-checkpoint, or choose another --ckpt-dir") from None
        return paths.hf.resolve()
    size = synthetic_bytes(spec)
    if size > SYNTHETIC_LIMIT_BYTES:
        raise ValueError(f"a synthetic checkpoint of {spec.name} at scale {spec.scale} would be {size / 2**30:.0f} GiB "
                         f"(limit {SYNTHETIC_LIMIT_BYTES >> 30} GiB): pass --hf-checkpoint or a smaller --scale "
                         f"(tiny or layers=N)")
    return None


def _prepare_hf(cfg: PrepareConfig, spec: ModelSpec, paths: CheckpointPaths, source: Path | None,
                say: Callable[[str], None]) -> tuple[bool, str, str]:
    """Returns (synthetic, identity of the HF checkpoint for the torch_dist request, action)."""
    from weightsync.sources.hf_source import synthetic_bytes, write_synthetic_hf
    from weightsync.sources.output_dir import atomic_output, is_complete, remove_stale_temps

    remove_stale_temps(paths.hf)
    if source is not None and source == paths.hf.resolve():
        say(f"HF checkpoint: {paths.hf} (existing, checked against {spec.name} {spec.scale}; used in place)")
        return False, "in-place:" + _dir_fingerprint(paths.hf), "used in place"
    request: dict[str, Any] = {"format": FORMAT_VERSION, "model": spec.name, "scale": spec.scale,
                               "spec": _spec_fingerprint(spec)}
    if source is None:
        request.update(source="synthetic", seed=cfg.seed)
    else:
        request.update(source=str(source), source_files=_dir_fingerprint(source))
    identity = _fingerprint(request)
    label = ("SYNTHETIC (seeded random-init weights, seed "
             f"{cfg.seed}; not a trained model)" if source is None else f"copy of {source}")
    if is_complete(paths.hf, request):
        say(f"HF checkpoint: {paths.hf} -- {label} -- complete, skipped")
        return source is None, identity, "skipped (complete)"
    with atomic_output(paths.hf, request, info=lambda: {"synthetic": source is None}) as tmp:
        if source is None:
            bar = _Bar(cfg.progress, synthetic_bytes(spec), f"synthetic {spec.name}")
            try:
                write_synthetic_hf(tmp, spec, cfg.seed, progress=bar)
            finally:
                bar.close()
        else:
            _copy_dir(source, tmp, cfg.progress)
    say(f"HF checkpoint: {paths.hf} -- {label} -- written")
    return source is None, identity, "written"


def _copy_dir(src: Path, dst: Path, progress: bool) -> None:
    """Hard-link (same file system) or copy every file of ``src`` into ``dst``."""
    files = [p for p in sorted(src.iterdir()) if p.is_file()]
    bar = _Bar(progress, sum(p.stat().st_size for p in files), f"copy {src.name}")
    try:
        for p in files:
            try:
                (dst / p.name).hardlink_to(p)
            except OSError:
                shutil.copy2(p, dst / p.name)
            bar(p.stat().st_size)
    finally:
        bar.close()


# --------------------------------------------------------------------------- torch_dist


def _prepare_torch_dist(cfg: PrepareConfig, spec: ModelSpec, paths: CheckpointPaths, train: TrainParallel,
                        hf_identity: str, say: Callable[[str], None]) -> str:
    from weightsync.models.checkpoint import HFCheckpoint
    from weightsync.sources.hf_source import global_reader
    from weightsync.sources.output_dir import atomic_output, is_complete, remove_stale_temps
    from weightsync.sources.torch_dist import write_torch_dist

    remove_stale_temps(paths.torch_dist)
    request = {"format": FORMAT_VERSION, "model": spec.name, "scale": spec.scale, "spec": _spec_fingerprint(spec),
               "hf": hf_identity, "train": dataclasses.asdict(train), "expert_naming": "sequential"}
    shards = f"{train.world_size} rank(s), tp={train.tp} pp={train.pp} cp={train.cp} ep={train.ep} etp={train.etp}"
    if is_complete(paths.torch_dist, request):
        say(f"torch_dist: {paths.torch_dist} ({shards}) -- complete, skipped")
        return "skipped (complete)"
    summary: dict[str, Any] = {}
    with atomic_output(paths.torch_dist, request, info=lambda: summary) as tmp, HFCheckpoint(paths.hf) as ckpt:
        from weightsync.models.hf import global_tensors

        total = sum(g.nbytes for g in global_tensors(spec).values() if g.quant_of is None)
        bar = _Bar(cfg.progress, total, f"torch_dist {spec.name}")
        try:
            written = write_torch_dist(tmp, spec, train, global_reader(ckpt, spec), progress=bar)
        finally:
            bar.close()
        summary.update(dataclasses.asdict(written))
    say(f"torch_dist: {paths.torch_dist} ({shards}; {summary['keys']} keys, {summary['chunks']} chunks) -- written")
    return "written"


# --------------------------------------------------------------------------- prompts


def _load_prompt_records(path: Path | None) -> list[dict[str, str]]:
    from weightsync.data import BUNDLED, read_prompt_file

    return read_prompt_file(path if path is not None else BUNDLED)


def _write_prompts(paths: CheckpointPaths, source: Path | None, records: list[dict[str, str]]) -> tuple[Path, str]:
    from weightsync.data import write_prompt_file

    name = (source.stem if source is not None else BUNDLED_PROMPTS_NAME) + ".jsonl"
    target = paths.datasets / name
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if target.is_file() and target.read_text() == text:
        return target, "skipped (complete)"
    paths.datasets.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.tmp")
    write_prompt_file(records, tmp)
    tmp.replace(target)
    return target, "written"
