"""A network namespace of a test's own, linked to this host by a veth pair (addresses from
198.18.0.0/15, reserved for network tests): a peer that reaches this host over a network, as
another machine would. Made by :func:`veth_peer` and removed when its block ends."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@contextmanager
def veth_peer(tag: str, host_ip: str, peer_ip: str) -> Iterator[str]:
    """A namespace at ``peer_ip`` linked to this host at ``host_ip`` (both /24); yields its name
    (run a command there with ``ip netns exec NAME ...``). Skips the test without root or ``ip``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` (a network namespace)")
    tag = f"{tag}{os.getpid() % 10**5}"
    ns, here, there = f"wsn{tag}", f"wsv{tag}a", f"wsv{tag}b"
    steps = [("netns", "add", ns), ("link", "add", here, "type", "veth", "peer", "name", there),
             ("link", "set", there, "netns", ns), ("addr", "add", f"{host_ip}/24", "dev", here),
             ("-n", ns, "addr", "add", f"{peer_ip}/24", "dev", there), ("link", "set", here, "up"),
             ("-n", ns, "link", "set", there, "up"), ("-n", ns, "link", "set", "lo", "up")]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"network namespaces unavailable (`ip {' '.join(step)}`: {done.stderr.strip()})")
        yield ns
    finally:
        _ip("netns", "del", ns)
        _ip("link", "del", here)
