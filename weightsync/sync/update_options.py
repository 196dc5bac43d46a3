"""The named choices of a pause-free update, importable without torch (the CLI builds its parsers
from them; :mod:`weightsync.sync.updater_config` and :mod:`weightsync.sync.weight_copies` check
values against them; the engine lists its control extensions from here)."""

from __future__ import annotations

FLIPS = ("swap", "copy")
"""How a session's copy becomes the served one: ``swap`` the copies' roles, or ``copy`` the
shadow into the served copy (whose addresses never change)."""

PAUSE_FREE = ("auto", "on", "off")
""":attr:`~weightsync.sync.updater_config.UpdaterConfig.pause_free`."""

CONTROL_EXTENSIONS = ("begin_weight_update.pause_generation", "end_weight_update.fingerprint_seed",
                      "update_weight_version.continue_generation")
"""The control calls' extension fields an engine of this project takes (``/server_info``'s
``weightsync.control_extensions``): with all of them an update's pause is one call shorter at each
end and its verification rides on ``end_weight_update``. sglang drops fields it does not know, so
the updater sends them only to an engine that lists them."""
