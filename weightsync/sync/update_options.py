"""The named choices of a pause-free update, importable without torch (the CLI builds its parsers
from them; :mod:`weightsync.sync.updater_config` and :mod:`weightsync.sync.weight_copies` check
values against them)."""

from __future__ import annotations

FLIPS = ("swap", "copy")
"""How a session's copy becomes the served one: ``swap`` the copies' roles, or ``copy`` the
shadow into the served copy (whose addresses never change)."""

PAUSE_FREE = ("auto", "on", "off")
""":attr:`~weightsync.sync.updater_config.UpdaterConfig.pause_free`."""
