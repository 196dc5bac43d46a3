"""The fingerprint of written weights: a seeded, position-dependent 64-bit hash of every element,
summed modulo 2^64, so that partials over disjoint element ranges add up to the whole.

The engine hashes each parameter it holds, on the device that holds it; each trainer rank hashes
exactly the element ranges it wrote (its plan share, after conversion and packing), from device
memory; the trainer ranks' partials summed equal the engine's value when every byte landed where
the plan put it. No weight is gathered or copied to the host on either side.

* ``hash``   the definition (:func:`~weightsync.fingerprint.hash.element_hash`, the torch path)
* ``batch``  many ranges of many tensors into slots in one pass (:class:`FingerprintBatch`; a
  Triton kernel on a GPU, torch elsewhere, the same values)

Imports torch only (Triton where the kernel runs).
"""

from weightsync.fingerprint.batch import FingerprintBatch, whole_tensors
from weightsync.fingerprint.hash import DEFAULT_SEED, MASK64, fingerprint_tensor, to_hex, zeros_fingerprint

__all__ = ["DEFAULT_SEED", "MASK64", "FingerprintBatch", "fingerprint_tensor", "to_hex", "whole_tensors",
           "zeros_fingerprint"]
