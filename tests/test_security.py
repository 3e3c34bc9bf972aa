"""Secure defaults: loopback-only capture sockets, key-or-loopback control routes, confined shm files."""

import asyncio
import os

import httpx
import pytest
from fastapi import FastAPI

from vllm_specrl import endpoints
from vllm_specrl.capture.receiver import CaptureReceiver
from vllm_specrl.capture.sender import CaptureSender
from vllm_specrl.security import (AddressRefused, confined_file, is_local_zmq_address, is_loopback_host,
                                  unauthenticated_remote_allowed)
from vllm_specrl.sync import shm


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("10.0.0.1", False), ("0.0.0.0", False), ("::", False), ("*", False),
    ("192.168.1.20", False), ("::ffff:10.0.0.1", False), ("", False), (None, False),
    ("no-such-host.invalid", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("address,local", [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:5557", True), ("tcp://[::1]:5557", True),
    ("ipc:///tmp/specrl-capture", True), ("inproc://x", True), ("tcp://*:5557", False),
    ("tcp://0.0.0.0:5557", False), ("tcp://10.1.2.3:5557", False), ("127.0.0.1:5557", False),
    ("udp://127.0.0.1:5557", False)])
def test_zmq_addresses(address, local):
    assert is_local_zmq_address(address) is local


def test_capture_receiver_binds_loopback_only_unless_allowed():
    with pytest.raises(AddressRefused, match="--capture-allow-remote"):
        CaptureReceiver("tcp://0.0.0.0:0")
    with pytest.raises(AddressRefused):
        CaptureReceiver("tcp://*:0")
    remote = CaptureReceiver("tcp://0.0.0.0:0", allow_remote=True)  # the documented opt-out binds
    remote.close()
    local = CaptureReceiver("tcp://127.0.0.1:0")
    local.close()


def test_capture_sender_connects_loopback_only_unless_allowed():
    with pytest.raises(AddressRefused, match="capture_allow_remote"):
        CaptureSender("tcp://10.1.2.3:5557")
    sender = CaptureSender("tcp://10.1.2.3:5557", allow_remote=True)
    sender.close()


def test_shm_paths_are_resolved_and_confined(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    good = base / "specrl-1-abc.safetensors"
    good.write_bytes(b"x")
    assert confined_file(str(good), base, "specrl-", ".safetensors") == good.resolve()
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    link = base / "specrl-link.safetensors"
    os.symlink(secret, link)
    for bad in (link, base / "specrl-../secret.safetensors", f"{base}/specrl-x/../../secret.safetensors",
                base / "other.safetensors", base / "specrl-1.bin", tmp_path / "specrl-1.safetensors"):
        with pytest.raises(ValueError, match="not a"):
            confined_file(str(bad), base, "specrl-", ".safetensors")


def test_shm_chunks_leave_no_temporary_files(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    path = shm.write_chunk({"w": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert oct(os.stat(path).st_mode & 0o077) == "0o0"  # not readable by other users
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("full")))
    with pytest.raises(OSError):
        shm.write_chunk({"w": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


class FakeEngine:
    """Just enough of vLLM's EngineClient for the pause route."""

    vllm_config = None

    def __init__(self):
        self.paused = []

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.paused.append(mode)

    async def resume_generation(self) -> None:
        pass


def call(state, method: str, path: str, client_host: str, headers: dict | None = None) -> httpx.Response:
    app = FastAPI()
    endpoints.SpecRLEndpointPlugin().attach_router(app)
    app.state.specrl = state

    async def go():
        transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.request(method, path, headers=headers, json={} if method == "POST" else None)
    return asyncio.run(go())


def test_without_a_key_only_loopback_clients_may_change_the_engine(monkeypatch):
    monkeypatch.delenv("VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE", raising=False)
    engine = FakeEngine()
    state = endpoints.SpecRLHttpState(engine, [], unauthenticated_remote_allowed(False))
    for path in ("/specrl/pause", "/specrl/resume", "/specrl/update/begin", "/specrl/capture",
                 "/specrl/update/u1/commit", "/specrl/update/u1/shm"):
        refused = call(state, "POST", path, "10.0.0.7")
        assert refused.status_code == 403 and "--api-key" in refused.json()["detail"], (path, refused.text)
    assert engine.paused == []
    assert call(state, "POST", "/specrl/pause", "127.0.0.1").status_code == 200
    assert call(state, "POST", "/specrl/pause", "::1").status_code == 200
    assert engine.paused == ["keep", "keep"]


def test_a_key_admits_remote_clients_and_the_opt_out_is_explicit(monkeypatch):
    engine = FakeEngine()
    keyed = endpoints.SpecRLHttpState(engine, ["s3cret"])
    assert call(keyed, "POST", "/specrl/pause", "10.0.0.7").status_code == 401
    assert call(keyed, "POST", "/specrl/pause", "10.0.0.7",
                {"Authorization": "Bearer s3cret"}).status_code == 200
    assert call(keyed, "POST", "/specrl/pause", "127.0.0.1").status_code == 401  # a key binds loopback too
    monkeypatch.setenv("VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE", "1")
    opened = endpoints.SpecRLHttpState(engine, [], unauthenticated_remote_allowed(False))
    assert call(opened, "POST", "/specrl/pause", "10.0.0.7").status_code == 200
    monkeypatch.delenv("VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE")
    assert endpoints.SpecRLHttpState(engine, [], unauthenticated_remote_allowed(True)) \
        .allow_unauthenticated_remote


def test_the_calibration_token_goes_only_to_a_caller_the_routes_admit(monkeypatch):
    """The sweep's secret (``adaptive.calibration_ids``) is what marks its requests: without the key (or,
    keyless, from another host) no token, so no client can make its requests the sweep's."""
    from vllm_specrl.adaptive import calibration_ids

    monkeypatch.setenv(calibration_ids.TOKEN_ENV, "feedc0de")
    monkeypatch.delenv("VLLM_SPECRL_ALLOW_UNAUTHENTICATED_REMOTE", raising=False)
    keyed = endpoints.SpecRLHttpState(FakeEngine(), ["s3cret"])
    assert call(keyed, "POST", "/specrl/calibrate", "10.0.0.7").status_code == 401
    given = call(keyed, "POST", "/specrl/calibrate", "10.0.0.7", {"Authorization": "Bearer s3cret"})
    assert given.status_code == 200 and given.json()["token"] == "feedc0de"
    keyless = endpoints.SpecRLHttpState(FakeEngine(), [], unauthenticated_remote_allowed(False))
    assert call(keyless, "POST", "/specrl/calibrate", "10.0.0.7").status_code == 403
    assert call(keyless, "POST", "/specrl/calibrate", "127.0.0.1").json()["token"] == "feedc0de"
