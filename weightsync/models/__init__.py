"""Models: architecture specs, the registry of the reference system's models, and run profiles.

Typical usage::

    from weightsync.models import get_model, get_profile
    spec = get_model("Kimi-K2")              # full size
    tiny = get_model("Kimi-K2", "tiny")      # same structure, small dims
    cut = get_model("GLM-5", "layers=4")     # real shapes, first 4 layers
    profile = get_profile("Kimi-K2")         # 256 + 256 GPUs, train and sglang sizes
"""

from weightsync.models.profiles import get_profile, list_profiles
from weightsync.models.profiles_base import RunProfile
from weightsync.models.registry import get_model, list_models, parse_scale, scale_spec
from weightsync.models.spec import Family, ModelSpec

__all__ = [
    "Family",
    "ModelSpec",
    "RunProfile",
    "get_model",
    "get_profile",
    "list_models",
    "list_profiles",
    "parse_scale",
    "scale_spec",
]
