"""HTTP client of one rollout engine, by sglang's endpoint names.

The same client drives the built-in engine and a real sglang server: every method is one
endpoint with sglang's request shape. Errors carry the endpoint and the server's message.

Typical usage::

    eng = EngineClient("http://127.0.0.1:30000")
    eng.wait_healthy(timeout_s=60)
    eng.pause_generation(); eng.begin_weight_update(); ...; eng.continue_generation()
"""

from __future__ import annotations

import time
from typing import Any

import httpx


class EngineError(RuntimeError):
    """An engine endpoint answered with an error status (or not at all)."""


class EngineClient:
    """One engine's control and generation API (see the module docstring)."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.base_url}{path}: engine unreachable ({exc.__class__.__name__}: {exc})") from exc
        if r.status_code >= 400:
            raise EngineError(f"{self.base_url}{path}: HTTP {r.status_code}: {r.text[:500]}")
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

    # -- information ----------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        return self._call("GET", "/server_info")

    def parallelism_config(self, rank: int) -> dict[str, Any]:
        return self._call("GET", "/parallelism_config", params={"rank": rank})

    def transfer_engine_info(self, rank: int) -> dict[str, Any]:
        return self._call("GET", "/get_remote_instance_transfer_engine_info", params={"rank": rank})

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
    def begin_weight_update(self, selector: str = "all") -> Any:
        return self._call("POST", "/begin_weight_update", json={"selector": selector})

    def end_weight_update(self) -> Any:
        return self._call("POST", "/end_weight_update", json={})

    def update_weight_version(self, version: str) -> Any:
        return self._call("POST", "/update_weight_version", json={"new_version": version, "abort_all_requests": False})

    def init_weights_update_group(self, **body: Any) -> Any:
        return self._call("POST", "/init_weights_update_group", json=body)

    def update_weights_from_distributed(self, **body: Any) -> Any:
        return self._call("POST", "/update_weights_from_distributed", json=body)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                                   flush_cache: bool = False) -> Any:
        """sglang's colocated update: one serialized entry per engine TP rank."""
        return self._call("POST", "/update_weights_from_tensor",
                          json={"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                                "flush_cache": flush_cache})

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self._call("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    def weights_checker(self, action: str, **extra: Any) -> Any:
        return self._call("POST", "/weights_checker", json={"action": action, **extra})
