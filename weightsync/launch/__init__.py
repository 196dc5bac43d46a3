"""Process placement, the run loop (``run``), validation gates and the transfer benchmark.

Above the library (:mod:`weightsync.sync`), the engine and the weight sources; below the commands
(:mod:`weightsync.cli`).
"""
