"""What ``prepare`` fetches from the Hugging Face hub, as the reference system's ``prepare`` does:
the run profile's checkpoint repository and its prompt dataset, through ``huggingface_hub``.

Files land in the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``, read by ``huggingface_hub``
itself); a repository already there is used without the network, and with ``HF_HUB_OFFLINE=1``
only the cache is read. When the hub cannot be reached and the cache has no copy, the caller gets
:class:`HubUnavailable` with a one-line message.

Typical usage::

    snapshot = fetch_model("Qwen/Qwen3-4B")        # a directory of config.json + safetensors
    prompts = fetch_prompt_file("zhuzilin/dapo-math-17k")
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.py", "*.jinja"]
"""What a checkpoint download fetches: config, weights (safetensors only), tokenizer files."""
DATASET_FILES = ["*.jsonl"]


class HubUnavailable(ValueError):
    """The hub could not be reached (or refused the repository) and the cache has no copy."""


def _snapshot(repo: str, repo_type: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return Path(snapshot_download(repo, repo_type=repo_type, allow_patterns=patterns))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        raise HubUnavailable(f"the Hugging Face hub cannot be reached and the local cache has no {repo_type} {repo} "
                             f"({type(exc).__name__})") from None
    except HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubUnavailable(f"the Hugging Face hub refused {repo_type} {repo}: {first}") from None
    except OSError as exc:  # network errors below huggingface_hub's own types
        raise HubUnavailable(f"the Hugging Face hub cannot be reached for {repo_type} {repo}: {exc}") from None


def fetch_model(repo: str) -> Path:
    """The snapshot directory of checkpoint repository ``repo`` (downloaded or from the cache).

    Raises:
        HubUnavailable: not reachable and not cached, or refused (gated, unknown).
    """
    return _snapshot(repo, "model", MODEL_FILES)


def fetch_prompt_file(repo: str) -> Path:
    """The prompt file (``.jsonl``) of dataset repository ``repo`` (the one named like the repo when
    it has several).

    Raises:
        HubUnavailable: not reachable and not cached, refused, or the dataset holds no ``.jsonl``.
    """
    snapshot = _snapshot(repo, "dataset", DATASET_FILES)
    files = sorted(snapshot.rglob("*.jsonl"))
    if not files:
        raise HubUnavailable(f"dataset {repo} has no .jsonl prompt file")
    named = [f for f in files if f.stem == repo.rsplit("/", 1)[-1]]
    return (named or files)[0]
