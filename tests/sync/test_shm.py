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
