"""A server without the package's ``/specrl`` routes (the endpoint plugin not loaded, as with
``VLLM_PLUGINS=specrl``) is named as such by every client path, instead of a bare 404 minutes into a run.
A stand-in HTTP server that answers 404 everywhere, as ``vllm serve`` does without the plugin.

Engines: none; a ``VLLMServer`` handle is built, never started, to ask the stand-in for its status."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_specrl.sync.clients.response_check import SpecRLRoutesMissing


class _NoRoutes(BaseHTTPRequestHandler):
    def _not_found(self):
        body = b'{"detail":"Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _not_found

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_status_and_updates_name_the_missing_plugin(url):
    from vllm_specrl.sync.clients.engine_client import EngineClient

    client = EngineClient(url)
    for call in (client.status, client.resume, lambda: client.report_trainer({"step": 1})):
        with pytest.raises(SpecRLRoutesMissing, match=r"VLLM_PLUGINS=specrl,specrl_http"):
            call()


def test_the_status_command_and_the_server_handle_name_the_missing_plugin(url, capsys):
    from vllm_specrl import cli
    from vllm_specrl.launcher import VLLMServer

    assert cli.main(["status", "--engine", url]) == 1
    assert "specrl_http endpoint plugin did not load" in capsys.readouterr().err
    with pytest.raises(SpecRLRoutesMissing):
        VLLMServer("m", port=int(url.rsplit(":", 1)[1])).status()


def test_calibration_names_the_missing_plugin(url):
    from vllm_specrl.adaptive.k_sweep import calibrate

    with pytest.raises(SpecRLRoutesMissing, match="specrl_http endpoint plugin did not load"):
        calibrate(url, model="m", max_batch=1, steps=1)
