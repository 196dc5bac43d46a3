"""The base of the HTTP API's request bodies: strict types, unknown fields refused, and what
each field does here (:class:`Effect`).

Every body lists exactly the fields sglang accepts for it (the union of sglang 0.5.16 to 0.5.23,
``managers/io_struct.py`` and ``sampling/sampling_params.py``); each field is one of
(:class:`Effect`):

* **same** -- honoured as sglang honours it;
* **no effect** -- accepted, and its value cannot change anything in this engine (the note says
  why: no prefix cache, no request metrics, no disaggregation, one DP-attention group computes the
  batch ...);
* **unsupported** -- accepted at its default; any other value is refused (400) with a message
  naming the field and why (LoRA, multimodal input, grammar constraints ... are not built).

One deliberate difference: a field sglang does not have is refused (400, the message names it)
where sglang silently drops it, so that a misspelled field is an error, not a default. The
exceptions are this engine's own documented extensions (``/weights_checker``'s ``rank`` and
``seed``, ``/begin_weight_update``'s ``pause_free`` and ``flip``). Types are checked strictly (no
``"5"`` for 5); ``null`` for a sampling scalar means its default, as in sglang. The bodies
themselves: :mod:`weightsync.engine.io_generate` (``/generate``) and
:mod:`weightsync.engine.io_struct` (control, weight-update and checker requests, and
:data:`~weightsync.engine.io_struct.BODIES`, which docs/engine.md tabulates).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict


class TooLarge(Exception):
    """A request larger than the engine takes (HTTP 413): its body, or the work it asks for."""

    http_status: ClassVar[int] = 413


class Effect(enum.StrEnum):
    SAME = "same as sglang"
    NO_EFFECT = "accepted, no effect here"
    UNSUPPORTED = "accepted at its default; another value is refused (400)"


Selector = Literal["target", "draft", "all"]
NoteTable = dict[str, tuple[Effect, str]]
"""A body's notes: field -> (its effect here, why)."""


class RequestBody(BaseModel):
    """A request body: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    NOTES: ClassVar[NoteTable] = {}
    """Fields that are not plainly "same as sglang": their effect and why."""

    @classmethod
    def effect(cls, name: str) -> tuple[Effect, str]:
        return cls.NOTES.get(name, (Effect.SAME, ""))

    def refuse_unsupported(self, where: str = "") -> None:
        """Raise for an unsupported field set to something other than its default.

        Raises:
            ValueError: names the field and why it is not supported.
        """
        for name, (effect, why) in self.NOTES.items():
            if effect is not Effect.UNSUPPORTED:
                continue
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default and value not in (None, False, [], {}, *self.ACCEPTED.get(name, ())):
                raise ValueError(f"{where}{name}={value!r} is not supported by this engine: {why}")

    ACCEPTED: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Values of unsupported fields that still mean "off" (beam_width 1)."""
