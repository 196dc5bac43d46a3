"""Tokenizers of the engine: a built-in byte tokenizer for synthetic checkpoints, or the HF
tokenizer of a checkpoint directory when it has one and ``transformers`` is installed.

The byte tokenizer maps each UTF-8 byte ``b`` of the text to token ``b % vocab_size`` and decodes
tokens below 256 back to bytes (others are dropped); it exists so that ``/generate`` accepts
text for models whose checkpoints carry no tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer(Protocol):
    name: str
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes modulo the vocab (see the module docstring)."""

    name = "bytes"

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Bytes back to text (the byte tokenizer has no special tokens: the flags change nothing)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """``transformers.AutoTokenizer`` of a checkpoint directory."""

    name = "hf"

    def __init__(self, path: str, eos_token_ids: tuple[int, ...]) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        eos = eos_token_ids or ((self._tok.eos_token_id,) if self._tok.eos_token_id is not None else ())
        self.eos_token_ids = tuple(eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        return self._tok.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )


def _config_eos(path: Path) -> tuple[int, ...]:
    cfg = path / "config.json"
    if not cfg.is_file():
        return ()
    eos = json.loads(cfg.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_tokenizer(vocab_size: int, checkpoint: str | None) -> Tokenizer:
    """The checkpoint's HF tokenizer when it has one and transformers is importable, else bytes.

    Args:
        vocab_size: the model's vocab.
        checkpoint: checkpoint directory, or None.

    Returns:
        A tokenizer; its ``eos_token_ids`` come from config.json (or the HF tokenizer).
    """
    if checkpoint is None:
        return ByteTokenizer(vocab_size)
    path = Path(checkpoint)
    eos = _config_eos(path)
    if any((path / f).is_file() for f in _HF_TOKENIZER_FILES):
        if importlib.util.find_spec("transformers") is not None:
            return HFTokenizer(str(path), eos)
        logger.warning("%s has a tokenizer but transformers is not installed: using the byte tokenizer", path)
    return ByteTokenizer(vocab_size, eos)
