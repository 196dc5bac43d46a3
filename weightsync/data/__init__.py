"""Prompt data of the run loop: a bundled set of arithmetic prompts with answers, and a loader.

``math_prompts.jsonl`` (64 lines, written for weightsync) holds one JSON object per line,
``{"prompt": "What is 25 + 30? Answer:", "answer": "55"}``. ``prepare`` copies it (or a file given
with ``--prompt-data``) into the checkpoint directory; :func:`read_prompt_file` accepts the
same keys and also the reference system's dapo-math style (``prompt`` a list of chat messages,
``label`` the answer).

Typical usage::

    batch = load_prompts(8, offset=step)            # bundled prompts, cycling
    reward = math_reward(batch[0]["answer"], completion_text)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BUNDLED = Path(__file__).with_name("math_prompts.jsonl")
"""The bundled prompt file."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _normalize(record: object, where: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if isinstance(prompt, list):  # chat messages: use the user turns' text
        parts = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role", "user") == "user"]
        prompt = "\n".join(p for p in parts if isinstance(p, str))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: needs a non-empty 'prompt' (a string or a list of chat messages)")
    answer = record.get("answer", record.get("label", ""))
    if not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: 'answer' / 'label' must be a string or a number")
    return {"prompt": prompt, "answer": str(answer)}


def read_prompt_file(path: str | Path) -> list[dict[str, str]]:
    """Read and normalize a prompt file (JSON lines; blank lines skipped).

    Args:
        path: the ``.jsonl`` file.

    Returns:
        ``[{"prompt": str, "answer": str}, ...]`` in file order.

    Raises:
        ValueError: a line that is not JSON or lacks a prompt (the message names the line), or
            an empty file.
    """
    p = Path(path)
    out = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{n}: not JSON ({exc.msg})") from None
        out.append(_normalize(record, f"{p}:{n}"))
    if not out:
        raise ValueError(f"{p}: no prompts")
    return out


def write_prompt_file(records: list[dict[str, str]], path: str | Path) -> Path:
    """Write normalized records as JSON lines (the format :func:`read_prompt_file` reads)."""
    p = Path(path)
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return p


def load_prompts(count: int | None = None, *, offset: int = 0, path: str | Path | None = None) -> list[dict[str, str]]:
    """``count`` prompts starting at index ``offset``, cycling through the file.

    Args:
        count: how many (None: the whole file once, from ``offset``).
        offset: index of the first prompt (any integer; taken modulo the file length).
        path: a prompt file (default: the bundled one).

    Returns:
        ``[{"prompt": str, "answer": str}, ...]``.
    """
    records = read_prompt_file(path if path is not None else BUNDLED)
    n = len(records) if count is None else count
    return [records[(offset + i) % len(records)] for i in range(n)]


def math_reward(answer: str, completion: str) -> float:
    """1.0 when the first number in ``completion`` equals ``answer`` numerically, else 0.0."""
    m = _NUMBER.search(completion)
    if m is None:
        return 0.0
    try:
        return 1.0 if float(m.group(0)) == float(answer) else 0.0
    except ValueError:
        return 0.0
