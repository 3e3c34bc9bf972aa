"""``sync.shm``: chunks written to shared memory, mapped back as views (what every tensor-parallel rank
of a host shares), and the probe a client uses to learn whether the engine reads its /dev/shm.
No engine starts here."""

from __future__ import annotations

import os

import torch

from vllm_specrl.sync import shm


def test_a_mapped_chunk_is_the_written_one_and_outlives_its_name():
    tensors = {"w": torch.randn(3, 5), "i": torch.arange(7), "h": torch.randn(2, 3).bfloat16(),
               "b": torch.tensor([True, False]), "e": torch.empty(0, 4)}
    path = shm.write_chunk(tensors)
    mapped = shm.map_file(path)
    os.unlink(path)  # the writer deletes it at once; the pages stay while a view holds them
    assert set(mapped) == set(tensors)
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and mapped[name].shape == tensor.shape, name
        assert torch.equal(mapped[name], tensor), name
    assert not path.exists()


def test_the_probe_reads_back_its_token_and_nothing_else():
    path, token = shm.write_probe()
    try:
        assert shm.read_probe(path) == token
        assert shm.map_file(path) == {}
    finally:
        path.unlink()
    assert shm.read_probe(path) is None  # another container: the same name, no file
    chunk = shm.write_chunk({"w": torch.ones(2)})
    try:
        assert shm.read_probe(chunk) is None  # a chunk is not a probe
    finally:
        chunk.unlink()


def test_a_full_shared_memory_sends_the_chunk_another_way(tmp_path, monkeypatch):
    """A container's small /dev/shm: the API server stages the body per rank (None), the client sends
    the chunk over HTTP, rather than failing the update."""
    import errno

    from vllm_specrl.sync.http import routes
    from vllm_specrl.sync.clients.engine_client import EngineClient

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "absent")
    assert routes.write_body(b"x" * 10) is None
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    written = routes.write_body(b"abc")
    assert written.read_bytes() == b"abc" and written.parent == tmp_path

    def full(_tensors):
        raise OSError(errno.ENOSPC, "No space left on device")

    sent = []
    client = EngineClient("http://127.0.0.1:9", progress=False)
    monkeypatch.setattr(shm, "write_chunk", full)
    monkeypatch.setattr(client, "_post", lambda path, **kw: sent.append(path) or {"ok": True})
    client._upload("u1", {"w": torch.ones(2)}, "shm")
    assert sent == ["/specrl/update/u1/tensors"]


def test_a_write_into_a_mapped_tensor_stays_private():
    """A loader that writes into the tensor it is given (in place) must neither fault nor change what
    another rank mapping the same file reads: the mapping is copy-on-write."""
    path = shm.write_chunk({"w": torch.zeros(4)})
    try:
        mine, theirs = shm.map_file(path), shm.map_file(path)
        mine["w"].add_(1)
        assert torch.equal(mine["w"], torch.ones(4)) and torch.equal(theirs["w"], torch.zeros(4))
    finally:
        path.unlink()
