"""The installed console script answers as a user sees it.

Engines: one run of the installed console script: what a user types.
"""

import subprocess
import sys

import pytest

from vllm_specrl import cli
from vllm_specrl.cli import train_draft


def test_check_fixtures_names_the_problem(tmp_path, capsys):
    rc = cli.main(["check-fixtures", "--out", str(tmp_path), "--only", "tiny"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_check_fixtures_passes_on_the_built_fixture(fixture_root, capsys):
    assert cli.main(["check-fixtures", "--out", str(fixture_root), "--only", "tiny"]) == 0
    assert "tiny: ok" in capsys.readouterr().out


def test_unknown_fixture_is_an_error(tmp_path, capsys):
    assert cli.main(["fixtures", "--out", str(tmp_path), "--only", "huge"]) == 2
    assert "unknown fixtures ['huge']" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "vllm_specrl.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("vllm-specrl ")


def test_train_draft_offers_every_built_in_prompt_family():
    """The CLI lists its task choices without importing the trainer (torch): they must stay the trainer's."""
    from vllm_specrl.trainer.offline import TASKS

    train_draft = cli.build_parser()._subparsers._group_actions[0].choices["train-draft"]
    task = next(a for a in train_draft._actions if a.dest == "task")
    assert tuple(task.choices) == TASKS


@pytest.mark.parametrize(("argv", "want"), [([], -1), (["--target-layer", "last"], -1), (["--target-layer", "none"],
                                                                                         None),
                                            (["--target-layer", "12"], 12), (["--target-layer", "-2"], -2)])
def test_train_draft_starts_a_new_draft_from_the_target_layer_asked(argv, want):
    args = cli.build_parser().parse_args(["train-draft", "--offline", "--target", "t", "--draft", "d", *argv])
    assert args.target_layer == want


def test_init_draft_keeps_random_weights_unless_asked_and_refuses_a_bad_layer(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["init-draft", "--target", "t", "--out", "o"]).target_layer is None
    with pytest.raises(SystemExit):
        parser.parse_args(["init-draft", "--target", "t", "--out", "o", "--target-layer", "top"])
    assert "expected last, none or a layer index" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "want"), [([], 3), (["--mtp"], 1), (["--mtp", "--ttt-steps", "3"], 3),
                                            (["--ttt-steps", "2"], 2)])
def test_train_draft_trains_three_chained_positions_for_eagle3_and_one_for_an_mtp_layer(argv, want):
    args = cli.build_parser().parse_args(["train-draft", "--target", "t", "--draft", "d", *argv])
    assert train_draft.train_config(args).ttt_steps == want


def test_train_draft_passes_weight_decay_and_feature_noise_and_refuses_noise_for_an_mtp_layer(monkeypatch, capsys):
    parse = cli.build_parser().parse_args
    cfg = train_draft.train_config(parse(["train-draft", "--target", "t", "--draft", "d", "--weight-decay", "0.1",
                                   "--feature-noise", "0.2"]))
    assert (cfg.weight_decay, cfg.feature_noise) == (0.1, 0.2)
    assert (train_draft.train_config(parse(["train-draft", "--target", "t", "--draft", "d"])).feature_noise) == 0.0
    assert train_draft.train_config(parse(["train-draft", "--target", "t", "--draft", "d", "--start-anchor", "4"])
                             ).start_anchor == 4.0
    monkeypatch.setattr("vllm_specrl.cpu.malloc.keep_every_block_on_heap", lambda: None)
    args = parse(["train-draft", "--target", "t", "--draft", "d", "--mtp", "--capture", "tcp://127.0.0.1:1",
                  "--feature-noise", "0.2"])
    assert train_draft.run(args) == 2
    assert "--feature-noise applies to EAGLE-3 drafts" in capsys.readouterr().err
    assert train_draft.run(parse(["train-draft", "--target", "t", "--draft", "d", "--mtp", "--offline",
                                       "--start-anchor", "1"])) == 2
    assert "--start-anchor applies to EAGLE-3 drafts" in capsys.readouterr().err
    assert train_draft.run(parse(["train-draft", "--target", "t", "--draft", "d", "--offline",
                                       "--feature-noise", "-0.1"])) == 2
    assert "must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(("native", "want"), [(True, "bfloat16"), (False, "float32")])
def test_train_draft_generates_at_the_dtype_auto_resolves_to(monkeypatch, tmp_path, native, want):
    """``--dtype auto`` (the demo draft's) reaches the warm start resolved: vLLM gets a real dtype,
    the one the demo serves at on this CPU."""
    import torch

    from vllm_specrl.trainer import offline

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr("vllm_specrl.cpu.malloc.keep_every_block_on_heap", lambda: None)
    seen = {}
    monkeypatch.setattr(offline, "warm_start", lambda target, draft, prompts, cfg,
                        *a: seen.setdefault("cfg", cfg) and {})
    args = cli.build_parser().parse_args(["train-draft", "--offline", "--target", str(tmp_path), "--draft",
                                          str(tmp_path / "d"), "--dtype", "auto"])
    assert args.func(args) in (0, None)
    assert seen["cfg"].dtype == want
