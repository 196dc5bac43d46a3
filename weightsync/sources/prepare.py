"""``weightsync prepare MODEL``: the HF checkpoint, the trainer's torch_dist checkpoint and the
prompt data of a run, under one checkpoint directory.

Outputs, for ``<name>`` = ``MODEL`` at full scale, ``MODEL_tiny`` at tiny scale and
``MODEL_<N>layer`` at ``layers=N`` (the reference system's ``GLM-5_4layer`` style), and for a
checkpoint of the user's (``--hf-checkpoint DIR``) its own directory's name (``DIR``'s name, with
``_<N>layer`` at ``layers=N``: :func:`given_name`)::

    <ckpt>/<name>/               HF checkpoint: config.json + *.safetensors
    <ckpt>/<name>_torch_dist/    Megatron torch_dist checkpoint (weightsync.sources.torch_dist)
    <ckpt>/datasets/<prompts>.jsonl

``<ckpt>`` is ``--ckpt-dir``, else ``$CKPT_SAVE_DIR``, else ``/root/multinode`` (read by the
CLI entry point through :func:`weightsync.launch.config.env_settings`, the one place that
reads the environment).

The HF checkpoint, first found of:

1. ``--hf-checkpoint DIR`` (checked, then hard-linked or copied to ``<ckpt>/<DIR's name>``; used in
   place when it already is that directory); the model's name at the scale then points at it
   (``<ckpt>/.<MODEL_scale name>.given``), so that a later ``prepare`` or ``run`` of the model
   without ``--hf-checkpoint`` uses it again (``run`` after ``prepare --hf-checkpoint DIR`` serves
   DIR's weights);
2. what an earlier ``prepare`` recorded at ``<ckpt>/<name>`` (a copy of a real checkpoint is
   reused as such), or an HF checkpoint put there by hand (used in place);
3. at ``full`` / ``layers=N`` scale, the run profile's Hugging Face repository (``Qwen/Qwen3-4B``
   ...), fetched through ``huggingface_hub`` into its cache (:mod:`weightsync.sources.hub`; only
   ``prepare`` fetches, ``run`` never does); when the hub cannot be reached and nothing is cached,
   one line says so and ``prepare`` stops unless ``--synthetic`` asks for synthetic weights;
4. at ``tiny`` scale (the embedded default, whose shapes no published checkpoint has), or with
   ``--synthetic``: SYNTHETIC weights, seeded random-init values in the model's real layout,
   labelled so in the output and in the run's ``results.json`` (``meta.weights``).

The model's architecture and shapes are the checkpoint's own (its config.json, read by
:func:`weightsync.models.resolve.model_spec`), the registry's only for synthetic weights. The
prompt data is ``--prompt-data``, else (``full`` / ``layers=N``) the profile's prompt dataset from
the hub, else the bundled prompts. The torch_dist shards are those of ``PrepareConfig.train`` (the
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

from weightsync.models import get_profile, parse_scale
from weightsync.models.parallel import TrainParallel
from weightsync.models.resolve import model_spec
from weightsync.models.spec import ModelSpec

FORMAT_VERSION = 2
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


def given_name(checkpoint: str | Path, scale: str) -> str:
    """The output name of a checkpoint of the user's: its directory's name, ``_<N>layer`` added at
    ``layers=N`` (never ``datasets``, the prompt data's folder)."""
    name = Path(checkpoint).resolve().name
    name = f"{name}_checkpoint" if name == "datasets" else name
    kind, n = parse_scale(scale)
    return f"{name}_{n}layer" if kind == "layers" else name


def checkpoint_paths(ckpt_dir: str | Path, model: str, scale: str, *, name: str | None = None) -> CheckpointPaths:
    """The output paths of ``model`` at ``scale`` under ``ckpt_dir`` (``name``: a checkpoint of the
    user's, :func:`given_name`; default :func:`output_name`)."""
    root = Path(ckpt_dir)
    name = name or output_name(model, scale)
    return CheckpointPaths(root=root, hf=root / name, torch_dist=root / f"{name}_torch_dist",
                           datasets=root / "datasets")


def _given_record(ckpt_dir: Path, model: str, scale: str) -> Path:
    """Where the name of the checkpoint last given for ``model`` at ``scale`` is kept."""
    return Path(ckpt_dir) / f".{output_name(model, scale)}.given"


def recorded_given(ckpt_dir: str | Path, model: str, scale: str) -> str | None:
    """The output name of the checkpoint an earlier ``prepare --hf-checkpoint`` of ``model`` at
    ``scale`` wrote, while that directory exists; else None."""
    record = _given_record(Path(ckpt_dir), model, scale)
    try:
        name = record.read_text().strip()
    except OSError:  # none recorded
        return None
    return name if name and (Path(ckpt_dir) / name).is_dir() else None


def _record_given(ckpt_dir: Path, model: str, scale: str, name: str) -> None:
    record = _given_record(ckpt_dir, model, scale)
    tmp = record.with_name(f"{record.name}.tmp")
    tmp.write_text(name + "\n")
    tmp.replace(record)


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
    candidates += [TrainParallel(world_size=2, tp=2, ep=2 if spec.is_moe else 1, etp=1, mla_down_proj_replicated=rep),
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
    dtype: str = "bfloat16"
    """The trainer's weight dtype (``--dtype``; a float32 checkpoint stays float32 with ``float32``)."""
    synthetic: bool = False
    """Synthetic weights are wanted where no checkpoint is found (always so at ``tiny`` scale)."""
    fetch: bool = True
    """Fetch the profile's checkpoint and prompt data from the hub when none is in place (``run``: False)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareResult:
    """What ``prepare`` produced (or found complete)."""

    paths: CheckpointPaths
    spec: ModelSpec
    """The model the checkpoint holds (its config.json's, or the registry's for synthetic weights)."""
    synthetic: bool
    """The HF checkpoint holds synthetic (random-init) weights."""
    weights: str
    """``synthetic`` or ``checkpoint:<dir>`` (the directory the weights came from)."""
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

    given = (given_name(cfg.hf_checkpoint, cfg.scale) if cfg.hf_checkpoint is not None
             else recorded_given(cfg.ckpt_dir, cfg.model, cfg.scale))
    paths = checkpoint_paths(cfg.ckpt_dir, cfg.model, cfg.scale, name=given)
    source = _resolve_hf_source(cfg, paths, say)
    spec = _source_spec(cfg, paths, source)  # validates a checkpoint before anything is written
    train = None if cfg.download_only else (cfg.train or default_train(spec))
    if train is not None:
        check_trainer_config(spec, train)
    prompt_source = _prompt_source(cfg, say)
    prompts = _load_prompt_records(prompt_source)
    actions: dict[str, str] = {}
    hf_identity, actions["hf"] = _prepare_hf(cfg, spec, paths, source, say)
    if cfg.hf_checkpoint is not None:
        _record_given(paths.root, cfg.model, cfg.scale, paths.hf.name)
    if train is not None:
        actions["torch_dist"] = _prepare_torch_dist(cfg, spec, paths, train, hf_identity, say)
    prompt_file, actions["prompts"] = _write_prompts(paths, prompt_source, prompts)
    say(f"prompts: {prompt_file} ({len(prompts)} prompts) -- {actions['prompts']}")
    return PrepareResult(paths=paths, spec=spec, synthetic=source.path is None, weights=weights_label(paths.hf),
                         train=train, prompts=prompt_file, actions=actions)


def ensure_prepared(model: str, *, scale: str, ckpt_dir: str | Path, train: TrainParallel | None = None,
                    seed: int = 0, progress: bool = True, hf_checkpoint: str | Path | None = None,
                    dtype: str = "bfloat16", synthetic: bool = False) -> tuple[Path, Path]:
    """``prepare`` for a run: the given checkpoint, or the one in place, else synthetic weights where
    allowed (never a download); returns the ``(hf_dir, torch_dist_dir)`` the run loads.

    Raises:
        ValueError: as :func:`prepare`, and no checkpoint at ``full`` / ``layers=N`` scale without
            ``synthetic``.
    """
    result = prepare(PrepareConfig(model=model, scale=scale, ckpt_dir=Path(ckpt_dir), train=train, seed=seed,
                                   progress=progress, dtype=dtype, synthetic=synthetic, fetch=False,
                                   hf_checkpoint=Path(hf_checkpoint) if hf_checkpoint is not None else None))
    return result.paths.hf, result.paths.torch_dist


def weights_label(hf_dir: str | Path) -> str:
    """``synthetic`` or ``checkpoint:<dir>`` for an HF directory ``prepare`` wrote or found in place
    (the run's ``results.json`` ``meta.weights``)."""
    from weightsync.sources.output_dir import read_marker

    marker = read_marker(Path(hf_dir))
    if marker is None:
        return f"checkpoint:{Path(hf_dir).resolve()}"
    request = marker.get("request", {})
    if request.get("source") == "synthetic":
        return "synthetic"
    return f"checkpoint:{request.get('source')}"


# --------------------------------------------------------------------------- HF checkpoint


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSource:
    """Where the HF checkpoint of a ``prepare`` comes from."""

    path: Path | None
    """The checkpoint directory (None: synthetic weights)."""
    in_place: bool = False
    """``path`` is ``<ckpt>/<name>`` itself (put there by hand, or recorded by an earlier prepare)."""
    recorded: dict[str, Any] | None = None
    """The request of a complete copy an earlier ``prepare`` made at ``<ckpt>/<name>``."""
    repo: str = ""
    """The hub repository it was fetched from ("" when not fetched)."""


def _resolve_hf_source(cfg: PrepareConfig, paths: CheckpointPaths, say: Callable[[str], None]) -> HFSource:
    """The checkpoint to use, in the order of the module docstring (nothing is read or written yet)."""
    from weightsync.sources.output_dir import read_marker

    if cfg.hf_checkpoint is not None:
        path = Path(cfg.hf_checkpoint).resolve()
        return HFSource(path=path, in_place=path == paths.hf.resolve())
    marker = read_marker(paths.hf) if paths.hf.exists() else None
    if paths.hf.exists() and marker is None:
        return HFSource(path=paths.hf.resolve(), in_place=True)
    request = (marker or {}).get("request", {})
    if marker is not None and request.get("source") != "synthetic":
        from weightsync.sources.output_dir import damage

        why = damage(paths.hf, marker)
        if not why:
            return HFSource(path=paths.hf.resolve(), in_place=True, recorded=request)
        origin = Path(str(request.get("source")))
        if not origin.is_dir():
            raise ValueError(f"{paths.hf}, the copy of {origin} an earlier prepare made, is damaged ({why}) and "
                             f"{origin} is gone: pass --hf-checkpoint DIR (or remove {paths.hf})")
        say(f"HF checkpoint: {paths.hf} is damaged ({why}): copying {origin} again")
        return HFSource(path=origin.resolve(), repo=str(request.get("repo", "")))
    kind, _ = parse_scale(cfg.scale)
    if kind == "tiny" or cfg.synthetic or (marker is not None and not cfg.fetch):
        if kind == "tiny" and not cfg.synthetic and marker is None:
            say(f"{cfg.model} at tiny scale (the embedded default): SYNTHETIC weights, the registry's tiny shapes "
                "(a real checkpoint: --hf-checkpoint DIR, or --scale full to fetch the profile's)")
        return HFSource(path=None)
    repo = get_profile(cfg.model).hf_repo
    if not cfg.fetch:
        raise ValueError(f"no checkpoint of {cfg.model} at {paths.hf}: run `weightsync prepare {cfg.model} --scale "
                         f"{cfg.scale}` (fetches {repo}), pass --hf-checkpoint DIR, or --synthetic for seeded random "
                         "weights")
    from weightsync.sources.hub import HubUnavailable, fetch_model

    try:
        path = fetch_model(repo)
    except HubUnavailable as exc:
        raise ValueError(f"{exc}: pass --hf-checkpoint DIR, or --synthetic for seeded random weights") from None
    say(f"HF checkpoint: {repo} -> {path}")
    return HFSource(path=path, repo=repo)


def _source_spec(cfg: PrepareConfig, paths: CheckpointPaths, source: HFSource) -> ModelSpec:
    """The model of ``source`` (its config.json, checked against its tensors), or the registry's."""
    from weightsync.sources.hf_source import check_hf_checkpoint, synthetic_bytes

    if source.path is None:
        spec = model_spec(cfg.model, cfg.scale, dtype=cfg.dtype)
        size = synthetic_bytes(spec)
        if size > SYNTHETIC_LIMIT_BYTES:
            raise ValueError(f"a synthetic checkpoint of {spec.name} at scale {spec.scale} would be "
                             f"{size / 2**30:.0f} GiB (limit {SYNTHETIC_LIMIT_BYTES >> 30} GiB): pass --hf-checkpoint "
                             "or a smaller --scale (tiny or layers=N)")
        return spec
    foreign = source.in_place and source.recorded is None and source.path == paths.hf.resolve() \
        and cfg.hf_checkpoint is None
    try:
        _check_files_whole(source.path)
        spec = model_spec(cfg.model, cfg.scale, checkpoint=source.path, dtype=cfg.dtype)
        check_hf_checkpoint(source.path, spec)
    except ValueError as exc:
        if foreign:
            raise FileExistsError(f"{paths.hf} exists, was not written by weightsync and is not usable: {exc}. "
                                  f"Move it away, pass --hf-checkpoint, or choose another --ckpt-dir") from None
        raise
    return spec


def _check_files_whole(path: Path) -> None:
    """Refuse a checkpoint with a ``.safetensors`` file that is not whole (truncated, a bad header).

    Raises:
        ValueError: naming the directory, the file and what is wrong.
    """
    from weightsync.sources.output_dir import safetensors_damage

    for f in sorted(Path(path).glob("*.safetensors")):
        why = safetensors_damage(f)
        if why:
            raise ValueError(f"HF checkpoint {path}: {why}")


def _prompt_source(cfg: PrepareConfig, say: Callable[[str], None]) -> Path | None:
    """``--prompt-data``, else the profile's prompt dataset from the hub (full / layers=N), else None
    (the bundled prompts)."""
    if cfg.prompt_data is not None:
        return cfg.prompt_data
    datasets = get_profile(cfg.model).prompt_datasets
    if not cfg.fetch or parse_scale(cfg.scale)[0] == "tiny" or not datasets:
        return None
    from weightsync.sources.hub import HubUnavailable, fetch_prompt_file

    try:
        return fetch_prompt_file(datasets[0])
    except HubUnavailable as exc:
        say(f"prompts: {exc}; using the bundled prompts")
        return None


def _prepare_hf(cfg: PrepareConfig, spec: ModelSpec, paths: CheckpointPaths, source: HFSource,
                say: Callable[[str], None]) -> tuple[str, str]:
    """Returns (identity of the HF checkpoint for the torch_dist request, action)."""
    from weightsync.sources.hf_source import synthetic_bytes, write_synthetic_hf
    from weightsync.sources.output_dir import atomic_output, is_complete, remove_stale_temps

    remove_stale_temps(paths.hf)
    if source.recorded is not None:
        say(f"HF checkpoint: {paths.hf} -- copy of {source.recorded.get('source')} (an earlier prepare) -- complete, "
            "used")
        return _fingerprint(source.recorded), "skipped (recorded)"
    if source.in_place:
        say(f"HF checkpoint: {paths.hf} (existing, checked against {spec.name} {spec.scale}; used in place)")
        return "in-place:" + _dir_fingerprint(paths.hf), "used in place"
    request: dict[str, Any] = {"format": FORMAT_VERSION, "model": spec.name, "scale": spec.scale,
                               "spec": _spec_fingerprint(spec)}
    if source.path is None:
        request.update(source="synthetic", seed=cfg.seed)
    else:
        request.update(source=str(source.path), source_files=_dir_fingerprint(source.path), repo=source.repo)
    identity = _fingerprint(request)
    label = ("SYNTHETIC (seeded random-init weights, seed "
             f"{cfg.seed}; not a trained model)" if source.path is None else f"copy of {source.path}")
    if is_complete(paths.hf, request):
        say(f"HF checkpoint: {paths.hf} -- {label} -- complete, skipped")
        return identity, "skipped (complete)"
    with atomic_output(paths.hf, request, info=lambda: {"synthetic": source.path is None}) as tmp:
        if source.path is None:
            bar = _Bar(cfg.progress, synthetic_bytes(spec), f"synthetic {spec.name}")
            try:
                write_synthetic_hf(tmp, spec, cfg.seed, progress=bar)
            finally:
                bar.close()
        else:
            _copy_dir(source.path, tmp, cfg.progress)
    say(f"HF checkpoint: {paths.hf} -- {label} -- written")
    return identity, "written"


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
