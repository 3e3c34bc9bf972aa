"""Checks at load (``lifecycle.load_checks``): the numbers that make a draft unable to serve an engine
(NeMo RL #3960's short rotary table; a vocabulary map pointing outside the target) are errors; a draft
configured for fewer positions than served is a warning."""

from __future__ import annotations

import torch

from vllm_specrl.lifecycle.load_checks import configured_range, position_findings, rotary_rows, vocabulary_findings


def test_a_rotary_table_shorter_than_max_model_len_is_an_error():
    errors, warnings = position_findings(4096, 2048, {"max_position_embeddings": 2048})
    assert errors and "2048 positions" in errors[0] and "4096" in errors[0]
    assert warnings and "2048" in warnings[0]


def test_rope_scaling_extends_the_configured_range():
    config = {"max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}
    assert configured_range(config) == (8192, 8.0)
    assert position_findings(65536, 131072, config) == ([], [])
    assert position_findings(4096, 4096, {"max_position_embeddings": 4096}) == ([], [])


def test_rotary_rows_reads_the_smallest_table():
    model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model[0].cos_sin_cache = torch.zeros(512, 8)
    model[1].cos_sin_cache = torch.zeros(256, 8)
    assert rotary_rows(model) == 256
    assert rotary_rows(torch.nn.Linear(2, 2)) is None


def test_vocabulary_maps_must_fit_the_target():
    d2t = torch.tensor([0, 5, 10, 20])  # draft token i -> target token i + d2t[i]: 0, 6, 12, 23
    assert vocabulary_findings({"d2t": d2t}, 32, 4) == []
    assert "outside the target vocabulary [0, 16)" in vocabulary_findings({"d2t": d2t}, 16, 4)[0]
    assert "LM head 5 rows" in vocabulary_findings({"d2t": d2t}, 32, 5)[0]
    assert "onto a target token" in vocabulary_findings({"d2t": torch.tensor([1, 0, 0, 0])}, 32, 4)[0]
    assert "t2d has 30 entries" in vocabulary_findings({"d2t": d2t, "t2d": torch.zeros(30, dtype=torch.bool)}, 32, 4)[0]
    assert "no d2t map" in vocabulary_findings({}, 32, 16)[0]
    assert vocabulary_findings({}, 32, 32) == []
