"""HTTP client of one rollout engine, by sglang's endpoint names.

The same client drives the built-in engine and a real sglang server: every method is one
endpoint with sglang's request shape. Errors carry the endpoint and the server's message.

**Token.** An engine started with a token answers 401/403 without it. Every call sends
``Authorization: Bearer <token>`` when the client was built with a ``token`` (the caller passes
it: ``UpdaterConfig.token`` for an updater's clients, the run's token for the launcher's); the
client reads no environment.

**An update as a transaction** (the built-in engine; what it does with each call is the table
in docs/engine.md, "States")::

    eng.pause_generation()
    eng.begin_weight_update()          # opens a session; its id is remembered and sent with the
                                       # session's calls (X-Weightsync-Session)
    ...write...                        # p2p, update_weights_from_distributed / _tensor (no
                                       # weight_version: nothing is published by end)
    eng.end_weight_update()
    eng.weights_checker("fingerprint", seed=s)  # verify what every rank holds
    eng.update_weight_version(v)       # the publication
    eng.continue_generation()

**Pause-free** (the built-in engine with a shadow copy, :meth:`EngineClient.shadow`): no pause, no
continue; ``begin_weight_update(pause_free=True)`` answers the copy the session writes
(``target_copy``), and ``update_weight_version(v)`` after ``end_weight_update`` flips it in while
the engine keeps generating (the answer says how, and for how long generation stood still).

On a failure: :meth:`EngineClient.drop_session` (the built-in engine's
``abort_weight_update``), or leave it; a later session recovers the engine.
:meth:`EngineClient.engine_state` reads the state, ``weights_dirty``, the published
``weight_version`` and the open session.

**A real sglang server** is driven with the same calls, with two differences the client handles:
sglang has no ``/abort_weight_update``, so :meth:`EngineClient.drop_session` ends a failed
update's session with ``/end_weight_update`` (sglang 0.5.23 closes an open session whatever
happened inside it, ``SchedulerWeightUpdaterManager.end_weight_update``); the engine stays paused
and unpublished until the next update rewrites it. And sglang 0.5.16 has no session routes at all
(404): :meth:`EngineClient.begin_weight_update` then says so once and the client updates that
engine without sessions (0.5.16 accepts every update at any time). Which kind of engine it is
comes from ``/server_info``: the built-in engine adds a ``weightsync`` key, sglang does not.

Typical usage::

    eng = EngineClient("http://127.0.0.1:30000")
    eng.wait_healthy(timeout_s=60)
    eng.pause_generation(); eng.begin_weight_update(); ...; eng.continue_generation()
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Weightsync-Session"
"""Carries the update session id on the session's calls (the engine refuses another session's)."""

class EngineError(RuntimeError):
    """An engine endpoint answered with an error status (or not at all)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status (None: no answer)."""


class EngineClient:
    """One engine's control and generation API (see the module docstring)."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, token: str | None = None) -> None:
        """Args:
        base_url: ``http://host:port``.
        timeout_s: per request.
        token: the engine's access token, sent as ``Authorization: Bearer``; None: none.
        """
        self.base_url = base_url.rstrip("/")
        self.session_id: str | None = None
        """The update session this client opened last (sent with its calls until it ends)."""
        self.builtin: bool | None = None
        """The engine is weightsync's own (True) or sglang (False); None until ``/server_info`` was read."""
        self.sessions = True
        """The engine has update sessions (False: sglang before 0.5.23 answered 404 to ``begin``)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False, headers=headers)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, session: bool = False, **kw: Any) -> Any:
        if session and self.session_id is not None:
            kw["headers"] = {**kw.get("headers", {}), SESSION_HEADER: self.session_id}
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}{path}: engine unreachable ({exc.__class__.__name__}: {exc})") from exc
        if r.status_code >= 400:
            raise EngineError(f"{self.base_url}{path}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text

    def wait_healthy(self, *, timeout_s: float, proc_alive: Any = None) -> None:
        """Poll ``/health`` until it answers 200.

        Args:
            timeout_s: give up after this long.
            proc_alive: optional callable; when it returns False the engine died: stop at once.

        Raises:
            EngineError: not healthy in time, or the engine process exited.
        """
        end = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < end:
            if proc_alive is not None and not proc_alive():
                raise EngineError(f"{self.base_url}: engine process exited before it became healthy")
            try:
                if self._http.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise EngineError(f"{self.base_url}: not healthy after {timeout_s:.0f} s ({last})")

    def health(self, timeout_s: float = 5.0) -> tuple[int | None, dict[str, Any]]:
        """``/health`` once: its status and body (``None`` and ``{"error"}`` when it does not answer)."""
        try:
            r = self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError as exc:
            return None, {"error": f"{exc.__class__.__name__}: {exc}"}
        try:
            body = r.json()
        except ValueError:
            body = {}
        return r.status_code, body if isinstance(body, dict) else {}

    # -- information ----------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        """``/server_info`` (sglang's ``ServerArgs`` and more); tells :attr:`builtin`."""
        info = self._call("GET", "/server_info")
        self.builtin = isinstance(info, dict) and "weightsync" in info
        return info

    def engine_state(self) -> dict[str, Any]:
        """The built-in engine's ``{"state", "weights_dirty", "weight_version", "session_id",
        "pending_weight_version", "memory_released", "num_queued", "batch_running", "fault"}`` (``/server_info``'s
        ``internal_states``; a real sglang server answers other keys)."""
        states = self.server_info().get("internal_states") or [{}]
        return dict(states[0])

    def shadow(self) -> dict[str, Any] | None:
        """The built-in engine's shadow copies (``/server_info``'s ``weightsync.shadow``:
        ``pause_free``, per rank ``copies`` / ``published`` / ``swap``); None from an engine that
        publishes none (a real sglang server, or an older engine): it takes paused updates only."""
        facts = self.server_info().get("weightsync")
        return facts.get("shadow") if isinstance(facts, dict) else None

    def control_extensions(self) -> tuple[str, ...]:
        """The control calls' extension fields the engine takes (``/server_info``'s
        ``weightsync.control_extensions``; none from a real sglang server or an older engine)."""
        facts = self.server_info().get("weightsync")
        return tuple(facts.get("control_extensions") or ()) if isinstance(facts, dict) else ()

    def parallelism_config(self, rank: int) -> dict[str, Any] | None:
        """miles' build's record of ``rank``'s parallel coordinates; None where the route does not
        exist (release sglang answers 404)."""
        try:
            return self._call("GET", "/parallelism_config", params={"rank": rank})
        except EngineError as exc:
            if exc.status == 404:
                return None
            raise

    def transfer_engine_info(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s published parameter table (``remote_instance_transfer_engine_info``); None
        where it publishes none (sglang without its transfer engine answers 400 "Failed to get
        transfer engine info for rank R", ``http_server.py`` ``remote_instance_transfer_engine_info``)."""
        try:
            return self._call("GET", "/remote_instance_transfer_engine_info", params={"rank": rank})
        except EngineError as exc:
            if exc.status == 400 and "Failed to get transfer engine info" in str(exc):
                return None
            raise

    def get_weight_version(self) -> str:
        """The live weight version: ``/model_info`` (sglang 0.5.16+ answers 404 on the older
        ``/get_weight_version``, which is tried second, as miles does)."""
        try:
            return str(self._call("GET", "/model_info")["weight_version"])
        except (EngineError, KeyError, TypeError):
            return str(self._call("GET", "/get_weight_version")["weight_version"])

    # -- generation -----------------------------------------------------------------------------
    def generate(self, body: dict[str, Any]) -> Any:
        return self._call("POST", "/generate", json=body)

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._call("POST", "/pause_generation", json={"mode": mode})

    def continue_generation(self) -> Any:
        return self._call("POST", "/continue_generation", json={})

    def flush_cache(self) -> Any:
        return self._call("GET", "/flush_cache")

    # -- weight updates -------------------------------------------------------------------------
    def begin_weight_update(self, selector: str = "all", *, pause_free: bool = False, flip: str | None = None,
                            pause_generation: str | None = None) -> Any:
        """Open an update session on a paused engine (409 while serving or with a session open;
        sglang: 400 with a session open); its id (the built-in engine's ``session_id``) goes with
        this client's session calls. The built-in engine's extensions (sent only when set):
        ``pause_free``, a session on the shadow of a serving engine, published by a ``flip``
        (``swap`` or ``copy``); ``pause_generation``, pause with this mode first, in the same call
        (only to an engine that lists it, :meth:`control_extensions`: sglang would drop the field
        and refuse the begin). An engine without session routes (sglang 0.5.16: 404) is said so
        once and updated without sessions from then on (returns None)."""
        if not self.sessions:
            return None
        body: dict[str, Any] = {"selector": selector}
        if pause_free:
            body["pause_free"] = True
        if flip is not None:
            body["flip"] = flip
        if pause_generation is not None:
            body["pause_generation"] = pause_generation
        try:
            out = self._call("POST", "/begin_weight_update", json=body)
        except EngineError as exc:
            if exc.status != 404 or self.builtin:
                raise
            self.sessions = False
            log.warning("%s has no weight-update sessions (/begin_weight_update: 404, sglang before 0.5.23): "
                        "updating it without sessions; a failed update leaves it paused with partly written "
                        "weights until the next one", self.base_url)
            return None
        self.session_id = out.get("session_id") if isinstance(out, dict) else None
        return out

    def end_weight_update(self, fingerprint_seed: int | None = None) -> Any:
        """Post-load. Publishes only a version given inside the session (miles' order); otherwise
        the engine stays paused and dirty until :meth:`update_weight_version`. ``fingerprint_seed``
        (the built-in engine's extension, sent only when given): the answer's ``fingerprints`` are
        the session copy's, as ``weights_checker("fingerprint", seed=...)`` answers them. Nothing
        without sessions."""
        if not self.sessions:
            return None
        body = {} if fingerprint_seed is None else {"fingerprint_seed": int(fingerprint_seed)}
        return self._call("POST", "/end_weight_update", json=body, session=True)

    def abort_weight_update(self) -> Any:
        """End the session without publishing: paused, dirty at the old version (built-in engine)."""
        out = self._call("POST", "/abort_weight_update", json={}, session=True)
        self.session_id = None
        return out

    def drop_session(self) -> Any:
        """End a failed update's session without publishing anything; the engine stays paused.

        The built-in engine: ``abort_weight_update`` (paused, dirty at the old version). sglang:
        ``end_weight_update`` -- it has no abort route, and ``end`` closes whatever session is
        open (a 400 "no weight-update session is open" means there is none: fine); the weights
        stay partly written until the next update. Without sessions: nothing to end.
        """
        if self.builtin is not False:
            try:
                return self.abort_weight_update()
            except EngineError as exc:  # not known to be sglang yet: its 404 tells
                if self.builtin or exc.status != 404:
                    raise
                self.builtin = False
        self.session_id = None
        if not self.sessions:
            return None
        try:
            return self._call("POST", "/end_weight_update", json={})
        except EngineError as exc:
            if exc.status == 400 and "no weight-update session" in str(exc):
                return None
            raise

    def update_weight_version(self, version: str, *, continue_generation: bool = False) -> Any:
        """Inside a session: the version ``end_weight_update`` publishes; after it: the
        publication (clears dirty; a flip where the session wrote a shadow); on clean weights: a
        new label. The answer's ``effect`` says which (``pending``, ``published``, ``labelled``);
        a publication's also ``flip``, ``flip_at`` and ``engine_idle_s``. ``continue_generation``
        (the built-in engine's extension, sent only when set): continue generation in the same call."""
        body: dict[str, Any] = {"new_version": version, "abort_all_requests": False}
        if continue_generation:
            body["continue_generation"] = True
        out = self._call("POST", "/update_weight_version", json=body, session=True)
        if isinstance(out, dict) and out.get("effect") == "published":
            self.session_id = None
        return out

    def init_weights_update_group(self, **body: Any) -> Any:
        return self._call("POST", "/init_weights_update_group", json=body)

    def update_weights_from_distributed(self, **body: Any) -> Any:
        return self._call("POST", "/update_weights_from_distributed", json=body, session=True)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                                   flush_cache: bool = False) -> Any:
        """sglang's colocated update: one serialized entry per engine TP rank."""
        return self._call("POST", "/update_weights_from_tensor",
                          json={"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                                "flush_cache": flush_cache})

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> Any:
        """Inside a session: every tensor reloaded from the HF checkpoint at ``model_path`` (a path
        the engine can read)."""
        return self._call("POST", "/update_weights_from_disk",
                          json={"model_path": model_path, "weight_version": weight_version}, session=True)

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self._call("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    def weights_checker(self, action: str, **extra: Any) -> Any:
        return self._call("POST", "/weights_checker", json={"action": action, **extra})

    # -- the fleet (extensions of the built-in engine) ---------------------------------------------
    def mark_stale(self, published_version: str) -> Any:
        """Tell the engine the fleet published ``published_version`` without it (state ``stale``)."""
        return self._call("POST", "/mark_stale", json={"published_version": published_version})

    def join_from_peer(self, peers: list[str], *, wait: bool = False) -> Any:
        """Copy the fleet's version from the first healthy of ``peers``, verify it, serve it."""
        return self._call("POST", "/join_from_peer", json={"peers": peers, "wait": wait})

    def donate_weights(self, body: dict[str, Any]) -> Any:
        """Ask this engine to write its served copy into a joiner (``DonateWeightsReqInput``'s fields)."""
        return self._call("POST", "/donate_weights", json=body)

