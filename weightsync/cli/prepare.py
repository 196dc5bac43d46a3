"""``weightsync prepare MODEL``: write the HF checkpoint, the Megatron torch_dist shards and the
prompt data (see :mod:`weightsync.sources.prepare` and docs/trainer.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from weightsync.models.resolve import describe_model
from weightsync.sources.prepare import PrepareConfig, prepare, recorded_given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``weightsync prepare`` arguments."""
    parser.add_argument("model", help="registry model name (see `weightsync list`)")
    parser.add_argument("--ckpt-dir", type=Path, default=None,
                        help="output directory (default: $CKPT_SAVE_DIR, else /root/multinode)")
    parser.add_argument("--hf-checkpoint", type=Path, default=None,
                        help="use this HF checkpoint directory (config.json + safetensors; its config.json gives the "
                             "architecture and shapes) instead of fetching the profile's")
    parser.add_argument("--synthetic", action="store_true",
                        help="seeded random-init weights where no checkpoint is found (the tiny embedded default "
                             "always uses them) instead of stopping when the hub cannot be reached")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                        help="the trainer's weight dtype (default bfloat16; float32 keeps a float32 checkpoint)")
    parser.add_argument("--scale", default=None,
                        help="full, tiny, or layers=N (default: full when this machine has the profile's GPUs, "
                             "else tiny -- the embedded default, with its trainer layout)")
    parser.add_argument("--download-only", action="store_true",
                        help="only the HF checkpoint and the prompt data (no torch_dist conversion)")
    parser.add_argument("--prompt-data", type=Path, default=None,
                        help="prompt file (.jsonl with prompt/answer) instead of the bundled math prompts")
    parser.add_argument("--train", default=None,
                        help="parallel config of the torch_dist shards: the run profile's sizes with the keys given "
                             "replaced (tp, pp, cp, ep, etp, world, dp, last = last PP stage's layers, mla_rep = 1: "
                             "MLA down projections whole on every TP rank, as Megatron's TE spec; 0: split over TP, "
                             "as its local spec); keys not given keep the profile's, the world size too unless "
                             "world= or dp= is given, e.g. tp=2,ep=2,world=2 (default: the run profile when it fits "
                             "the scale, else a small configuration)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a synthetic HF checkpoint (default 0)")
    parser.add_argument("--head-ip", default="",
                        help="prepare for a multi-node run (as `run --head-ip`): the profile fits when this node has "
                             "a node's worth of its GPUs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve(args: argparse.Namespace) -> PrepareConfig:
    """What this invocation prepares: ``--train`` over the run profile
    (:func:`weightsync.models.fit.profile_sizes`, as in ``run``, ``plan`` and ``bench``); without
    ``--scale``, the scale (and, without ``--train``, the shards) of what ``run`` would run here.

    Raises:
        ValueError: a bad ``--train``, an environment variable that cannot be used, or a checkpoint
            directory that is a file or cannot be created or written (before anything is written).
    """
    # The CLI layer resolves the environment through the launcher's single reader.
    from weightsync.launch.config import env_settings, writable_dir
    from weightsync.models.fit import cuda_device_count, fit_profile, profile_sizes

    ckpt_dir = args.ckpt_dir
    writable_dir(ckpt_dir or env_settings().ckpt_dir, "--ckpt-dir" if ckpt_dir is not None else "CKPT_SAVE_DIR")
    if ckpt_dir is None:
        ckpt_dir = env_settings().ckpt_dir
    scale, train = args.scale, profile_sizes(args.model, args.train)[0] if args.train else None
    if scale is None:
        own = args.hf_checkpoint is not None or recorded_given(ckpt_dir, args.model, "tiny") is not None
        fit = fit_profile(args.model, cuda_device_count(), multi_node=bool(args.head_ip), checkpoint=own)
        if fit.note:
            print(fit.note)
        scale, train = fit.scale, train or fit.train
    return PrepareConfig(model=args.model, scale=scale, ckpt_dir=Path(ckpt_dir),
                         hf_checkpoint=args.hf_checkpoint, download_only=args.download_only,
                         prompt_data=args.prompt_data, train=train, seed=args.seed, progress=not args.no_progress,
                         dtype=args.dtype, synthetic=args.synthetic)


def main(args: argparse.Namespace) -> int:
    """Run ``weightsync prepare``; 0 on success, 2 on bad input or a checkpoint directory that
    cannot be written (one line saying what is wrong)."""
    try:
        result = prepare(resolve(args))
    except (ValueError, FileExistsError) as exc:
        print(f"weightsync prepare: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the checkpoint directory became unwritable (a full disk, a read-only mount)
        print(f"weightsync prepare: cannot write {exc.filename or 'the checkpoint directory'} ({exc.strerror or exc}); "
              "point CKPT_SAVE_DIR (or --ckpt-dir) at a writable directory",
              file=sys.stderr)
        return 2
    print(f"model: {describe_model(result.spec, None if result.synthetic else result.paths.hf)}")
    if result.synthetic:
        print("note: the HF checkpoint is SYNTHETIC (seeded random-init weights in the real layout); "
              "pass --hf-checkpoint DIR to use real weights")
    else:
        print(f"weights: {result.weights}")
    return 0
