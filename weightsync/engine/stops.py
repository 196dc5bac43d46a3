"""Stop strings and stop patterns (sglang's ``stop`` and ``stop_regex``), matched at bounded cost.

Both are searched in the decoded output after every generated token, on rank 0's driver thread.
A pattern is user input, and Python's ``re`` backtracks: ``(a+)+b`` against a run of ``a`` takes
time exponential in the run while holding the interpreter lock, so health checks, pause and
SIGTERM all waited on it. Patterns are therefore compiled and matched by RE2 (``google-re2``):
its automata match in time linear in the text whatever the pattern, its compiled program is
capped (:data:`MAX_PROGRAM_BYTES`), and it lets other threads run while it matches. Why RE2
rather than the alternatives: a worker process with a deadline bounds the time but adds a
process round trip per token and a kill path; refusing nested quantifiers is a heuristic that
misses other exponential shapes (``(a|a)*b``, ``(a|aa)+b``). RE2's syntax is Python's without
backreferences and lookaround; such patterns are refused when the request is parsed (400 naming
the pattern), as are more than :data:`MAX_STOPS` stop strings or patterns and any longer than
:data:`MAX_STOP_CHARS` characters, so a step's matching costs at most that many linear scans.

Matching never runs on the thread that serves control calls: the HTTP event loop answers them,
requests are parsed in worker threads, and the driver thread generates (and matches).
"""

from __future__ import annotations

import functools

import re2

MAX_STOPS = 32
"""Stop strings, and stop patterns, per request (each)."""
MAX_STOP_CHARS = 1024
"""Characters of one stop string or pattern."""
MAX_PROGRAM_BYTES = 1 << 20
"""Memory RE2 may use for one compiled pattern (its automata); a larger pattern is refused."""


def _options() -> re2.Options:
    opts = re2.Options()
    opts.max_mem = MAX_PROGRAM_BYTES
    opts.log_errors = False  # the refusal says why; nothing on the engine's stderr
    return opts


@functools.lru_cache(maxsize=256)
def compile_stop_pattern(pattern: str) -> re2._Regexp:
    """``pattern`` compiled for linear-time matching (cached: every step searches with it).

    Raises:
        ValueError: a pattern RE2 does not accept (backreferences, lookaround, too large), or too long.
    """
    if len(pattern) > MAX_STOP_CHARS:
        raise ValueError(f"stop_regex of {len(pattern)} characters: at most {MAX_STOP_CHARS}")
    try:
        return re2.compile(pattern, _options())
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"stop_regex {pattern!r} is not a pattern this engine matches in linear time ({why}; RE2 "
                         "syntax: no backreferences or lookaround)") from None


def check_stops(stop_strs: tuple[str, ...], stop_regex: tuple[str, ...], where: str = "") -> None:
    """Refuse stop strings and patterns beyond the bounds (module docstring).

    Raises:
        ValueError: naming the field, the bound and the offending value.
    """
    for field, values in (("stop", stop_strs), ("stop_regex", stop_regex)):
        if len(values) > MAX_STOPS:
            raise ValueError(f"{where}{field} has {len(values)} entries: at most {MAX_STOPS}")
        for value in values:
            if len(value) > MAX_STOP_CHARS:
                raise ValueError(f"{where}{field} entry of {len(value)} characters: at most {MAX_STOP_CHARS}")
    for pattern in stop_regex:
        try:
            compile_stop_pattern(pattern)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None


def match_stop(text: str, stop_strs: tuple[str, ...], stop_regex: tuple[str, ...]) -> str | None:
    """The first stop string contained in ``text``, or the first pattern found in it; None."""
    for s in stop_strs:
        if s and s in text:
            return s
    for pattern in stop_regex:
        if compile_stop_pattern(pattern).search(text) is not None:
            return pattern
    return None
