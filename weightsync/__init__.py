"""weightsync: move updated weights from a Megatron-sharded trainer into live sglang-layout
rollout engines, shard to shard, and prove every byte landed.

The public API is the weight-update facade (:mod:`weightsync.sync.updater`, its config and results)::

    from weightsync import UpdaterConfig, WeightUpdater
    with WeightUpdater(params, spec=spec, train=train, engine_urls=urls, group=group) as updater:
        stats = updater.update(version)

The names below are imported on first use, so that ``import weightsync.<module>`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["UpdateError", "UpdateStats", "UpdaterConfig", "WeightUpdater", "__version__"]

_FACADE = {
    "UpdateError": "weightsync.sync.update_result",
    "UpdateStats": "weightsync.sync.update_result",
    "UpdaterConfig": "weightsync.sync.updater_config",
    "WeightUpdater": "weightsync.sync.updater",
}
"""Each public name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    if name in _FACADE:
        return getattr(importlib.import_module(_FACADE[name]), name)
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
