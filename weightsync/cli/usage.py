"""What ``weightsync --help`` and each ``weightsync COMMAND --help`` tell a user: what the command
does, the environment variables it reads, examples; and a help formatter that shows every option's
default.

The options themselves (their choices, defaults and one-line help) stay with each sub-command's
``add_arguments``; this module holds the prose around them, in one place.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass

OVERVIEW = """\
weightsync moves updated model weights from a Megatron training job into live rollout engines
(sglang layout) after every RL step -- shard to shard, one-sided, straight into the engines'
parameters (p2p), or through the classic gather + broadcast -- and proves every byte landed.

Start here:
  weightsync list                    the models and their reference run profiles
  weightsync run Qwen3-4B            a whole run; on a machine without the profile's GPUs the
                                     embedded default (tiny scale, CPU), about a minute
  weightsync COMMAND --help          what a command does, its options, defaults and variables"""

DESCRIPTION_WIDTH = 100

ENVIRONMENT: dict[str, str] = {
    "CKPT_SAVE_DIR": "where checkpoints are written and read (default /root/multinode)",
    "SKIP_VALIDATION": "1: skip check-weight-update-equal at the first update (engines start from dummy weights)",
    "BUCKET_SIZE_GB": "bucket size in GiB of the broadcast and of p2p staging (default 1)",
    "MILES_LOG_DIR": "logs, results.json and the plot (default logs/<model>_<mode>_<time>)",
    "MOONCAKE_PROTOCOL": "Mooncake's protocol: auto (default: rdma where an RDMA port is active), tcp or rdma",
    "MOONCAKE_DEVICE": "Mooncake's RDMA device, e.g. mlx5_0",
    "WEIGHTSYNC_NODE_TIMEOUT_S": "multi-node: how long the head waits for the nodes to join (default 300)",
    "WEIGHTSYNC_RAY_PORT": "multi-node: the Ray head's port, the same on every node (default 6379)",
    "WEIGHTSYNC_TOKEN": "the engines' access token (Authorization: Bearer)",
    "HF_HOME": "the Hugging Face cache that downloads go to and are read from",
    "HF_HUB_OFFLINE": "1: read the Hugging Face cache only, never the network",
}
"""The variables the commands read, and what for (README.md's table says the same)."""


@dataclass(frozen=True, slots=True)
class Usage:
    """The prose of one sub-command's help."""

    summary: str
    """One line, in ``weightsync --help``'s list."""
    description: str
    """What the command does, at the top of its own help."""
    environment: tuple[str, ...]
    """The variables it reads (keys of :data:`ENVIRONMENT`)."""
    examples: tuple[str, ...]


USAGE: dict[str, Usage] = {
    "list": Usage(
        summary="the models, their sizes and their reference run profiles",
        description="List the registry's models: family, parameter count and bytes, and each one's reference run "
                    "profile (nodes, GPUs, trainer and engine parallel sizes), which every other command starts "
                    "from.",
        environment=(),
        examples=("weightsync list", "weightsync list --json")),
    "plan": Usage(
        summary="compute and verify a transfer plan on metadata (no weights, no GPUs)",
        description="Compute the static transfer plan of a model between a trainer layout and an engine layout, "
                    "from shapes alone, and print its size (ops, bytes per rollout rank); --verify checks that "
                    "every destination byte is written exactly once, from the right source bytes. The layouts "
                    "are the model's run profile with --train / --rollout replacing the keys they name.",
        environment=(),
        examples=("weightsync plan Qwen3-30B-A3B --verify",
                  "weightsync plan Kimi-K2 --mode broadcast --json",
                  "weightsync plan Qwen3-4B --scale tiny --train tp=2,cp=1,world=2 --rollout tp=2,engines=1")),
    "serve": Usage(
        summary="start the built-in rollout engine alone",
        description="Start the built-in rollout engine: tensor-parallel inference in the sglang layout behind "
                    "sglang's HTTP endpoints (/generate, /pause_generation, the weight-update routes), its "
                    "parameters registered with a p2p transport so that trainer ranks can write into them. Runs "
                    "until interrupted. A token (--token-file, else WEIGHTSYNC_TOKEN) is required to listen "
                    "beyond loopback.",
        environment=("WEIGHTSYNC_TOKEN",),
        examples=("weightsync serve Qwen3-4B --scale tiny --tp 2 --transport shm --load-format dummy --port 30000",
                  "weightsync serve Qwen3-4B --checkpoint /ckpt/my-qwen --tp 2 --transport shm")),
    "prepare": Usage(
        summary="write the checkpoints and prompt data a run loads",
        description="Write what a run loads, under CKPT_SAVE_DIR (or --ckpt-dir): the HF checkpoint "
                    "(--hf-checkpoint DIR, else the profile's Hugging Face repository at full or layers=N scale, "
                    "else SYNTHETIC seeded weights at tiny scale), the trainer's Megatron torch_dist shards and "
                    "the prompt data. Idempotent: a complete output is skipped. A directory that cannot be "
                    "written is refused before anything is written.",
        environment=("CKPT_SAVE_DIR", "HF_HOME", "HF_HUB_OFFLINE"),
        examples=("weightsync prepare Qwen3-4B",
                  "weightsync prepare Qwen3-4B --hf-checkpoint /models/my-qwen",
                  "CKPT_SAVE_DIR=/data/ckpt weightsync prepare Qwen3-30B-A3B --scale layers=4")),
    "run": Usage(
        summary="train and update the rollout engines every step, checking every byte",
        description="Run the RL loop against live rollout engines: each step the engines generate, the trainer "
                    "steps, the weights move into the engines (p2p, broadcast, or both alternating), and every "
                    "engine parameter is checked against the trainer's weights. Prints a line per step, a table "
                    "and a summary per mode, and writes results.json and update_phases.png into MILES_LOG_DIR. "
                    "Where this machine lacks the profile's GPUs (and no --scale / --train / --rollout / --device "
                    "is given) it runs the embedded default: the same family at tiny scale on CPU. Weights: "
                    "--hf-checkpoint DIR, else what prepare wrote, else synthetic at tiny scale (run never "
                    "downloads).",
        environment=("CKPT_SAVE_DIR", "SKIP_VALIDATION", "BUCKET_SIZE_GB", "MILES_LOG_DIR", "MOONCAKE_PROTOCOL",
                     "MOONCAKE_DEVICE", "WEIGHTSYNC_NODE_TIMEOUT_S", "WEIGHTSYNC_RAY_PORT", "WEIGHTSYNC_TOKEN"),
        examples=("weightsync run Qwen3-4B",
                  "weightsync run Qwen3-4B --mode both --num-rollout 4",
                  "weightsync run Qwen3-4B --hf-checkpoint /models/my-qwen",
                  "SKIP_VALIDATION=1 weightsync run GLM-4.7-Flash --transport mooncake",
                  "weightsync run GLM-4.7-Flash --node-rank 0 --head-ip 10.0.0.1   # the head; node 1: --node-rank 1")),
    "bench": Usage(
        summary="benchmark p2p against broadcast and the link's own copy rate",
        description="Measure, in one run on the same engines, p2p updates against broadcast updates and against "
                    "the link's own copy rate: best, mean and first update time and the rate per mode, with every "
                    "update checked bit for bit. Prints a table; --out writes the JSON record.",
        environment=(),
        examples=("weightsync bench Qwen3-4B",
                  "weightsync bench Qwen3-30B-A3B --scale layers=2 --device cuda --out bench.json")),
}


def description(name: str) -> str:
    """The top of ``weightsync NAME --help``: what the command does, wrapped."""
    return textwrap.fill(USAGE[name].description, width=DESCRIPTION_WIDTH)


def epilog(name: str) -> str:
    """The end of ``weightsync NAME --help``: the environment variables it reads and examples."""
    u = USAGE[name]
    width = max((len(v) for v in u.environment), default=0)
    env = [f"  {v:<{width}}  {ENVIRONMENT[v]}" for v in u.environment] or ["  none"]
    return "\n".join(["environment variables:", *env, "", "examples:", *(f"  {e}" for e in u.examples)])


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (their line breaks kept); every option's default shown
    where its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, "", argparse.SUPPRESS)
                and "default" not in text.lower()):
            text += " (default: %(default)s)"
        return text
