"""What may reach an engine or a trainer, and which files an update may name.

Secure by default: hidden states, weight updates and pause/commit control stay on
the host unless the operator says otherwise, in one documented place each
(``capture_allow_remote``, ``--capture-allow-remote``,
``allow_unauthenticated_remote`` / ``VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE=1``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

UNAUTHENTICATED_REMOTE_ENV = "VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE"


class AddressRefused(ValueError):
    """A socket address that would expose capture or control beyond this host."""


def is_loopback_host(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 (also IPv4-mapped) and names that resolve only to those."""
    if not host:
        return False
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if host == "*":
            return False
        try:
            infos = socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError):
            return False
        return bool(infos) and all(is_loopback_host(info[4][0]) for info in infos)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def is_local_zmq_address(address: str) -> bool:
    """``ipc://`` and ``inproc://`` are local; ``tcp://HOST:PORT`` only with a loopback HOST."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return is_loopback_host(host)


def require_local_zmq_address(address: str, allow_remote: bool, what: str, opt_out: str) -> str:
    """Refuse a non-loopback ZeroMQ address unless ``allow_remote`` (named by ``opt_out``)."""
    if not allow_remote and not is_local_zmq_address(address):
        raise AddressRefused(f"{what} address {address!r} is not loopback (tcp://127.0.0.1:PORT, ipc://...); "
                             f"{opt_out} to allow it")
    return address


def unauthenticated_remote_allowed(configured: bool = False) -> bool:
    """The opt-out that lets clients off the host mutate an engine with no API key set."""
    return configured or os.environ.get(UNAUTHENTICATED_REMOTE_ENV, "") in ("1", "true", "yes")


def confined_file(path: str | os.PathLike, directory: Path, prefix: str, suffix: str) -> Path:
    """``path`` resolved (symlinks, ``..``), which must be a ``prefix*suffix`` file directly in ``directory``."""
    resolved = Path(os.path.realpath(path))
    root = Path(os.path.realpath(directory))
    name = resolved.name
    if resolved.parent != root or not name.startswith(prefix) or not name.endswith(suffix):
        raise ValueError(f"{path}: not a {root}/{prefix}*{suffix} file")
    return resolved
