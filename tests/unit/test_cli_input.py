"""Bad input on every command line: one line naming the flag or key and the value,
exit status 2, nothing written, no traceback; config values that are not numbers
(``inf``, ``nan``, ``true``) refused where numbers belong."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlfleet.cli import main
from rlfleet.common import cli_args
from rlfleet.common.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ppo_tiny.yaml"


def _exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``rlfleet ARGV``'s status and stderr, whether it returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def test_argument_types_name_the_bad_value() -> None:
    assert cli_args.port("0") == 0 and cli_args.port("65535") == 65535
    assert cli_args.port_or_off("-1") == -1
    assert cli_args.log_level("debug") == "DEBUG"
    assert cli_args.address("[::1]:50050") == "[::1]:50050"
    assert cli_args.fraction("1") == 1.0
    for fn, text, words in [
        (cli_args.port, "99999", "0-65535 (got 99999)"),
        (cli_args.port, "-1", "(got -1)"),
        (cli_args.port, "http", "not an integer: 'http'"),
        (cli_args.port_or_off, "-2", "(got -2)"),
        (cli_args.positive_int, "0", "must be >= 1 (got 0)"),
        (cli_args.nonnegative_int, "-3", "must be >= 0 (got -3)"),
        (cli_args.positive_float, "inf", "must be finite (got inf)"),
        (cli_args.positive_float, "nan", "must be finite"),
        (cli_args.positive_float, "-5", "must be > 0 (got -5)"),
        (cli_args.fraction, "5", "(0, 1] (got 5)"),
        (cli_args.log_level, "NOPE", "(got 'NOPE')"),
        (cli_args.address, "nohost", "host:port (got 'nohost')"),
        (cli_args.address, "h:0", "1-65535"),
        (cli_args.address, ":80", "host:port"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words.replace("(", r"\(")
                           .replace(")", r"\)").replace("[", r"\[")):  # fmt: skip
            fn(text)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["serve", "rollout", "--insecure", "--port", "99999"], "--port: must be a port"),
        (["serve", "scheduler", "--insecure", "--metrics-port", "70000"], "--metrics-port"),
        (["serve", "reward", "--insecure", "--port", "-5"], "--port"),
        (["serve", "tools", "--insecure", "--log-level", "NOPE"], "--log-level"),
        (["serve", "trainer", "--insecure", "--port", "65536"], "--port"),
        (["serve", "rollout", "--insecure", "--gpu-memory-utilization", "5"], "(0, 1]"),
        (["serve", "rollout", "--insecure", "--torch-threads", "0"], "--torch-threads"),
        (["serve", "rollout", "--insecure", "--max-n", "0"], "--max-n"),
        (["train", "--config", str(EXAMPLE), "--metrics-port", "99999"], "--metrics-port"),
        (["train", "--config", str(EXAMPLE), "--torch-threads", "-1"], "--torch-threads"),
        (["train", "--config", str(EXAMPLE), "--start-timeout", "0"], "--start-timeout"),
        (["train", "--config", str(EXAMPLE), "--log-level", "NOPE"], "--log-level"),
        (["status", "--scheduler", "nohost"], "host:port (got 'nohost')"),
        (["status", "--timeout-s", "-1"], "--timeout-s"),
        (["scale", "rollout", "0"], "must be >= 1 (got 0)"),
        (["scale", "rollout", "4294967296"], "must be at most 1024"),
        (["scale", "rollout"], "give either a replica count or --watch-exec"),
        (["secrets", "tls", "--dir", "x", "--days", "0"], "--days"),
        (["reward", "info", "--addr", "nohost"], "--addr"),
        (["reward", "score", "--addr", "h:1", "--input", "x", "--batch-size", "0"], "--batch-size"),
        (["rollout", "generate", "--addr", "h:1", "--prompts", "x", "--n", "0"], "--n"),
        (["preprocess", "arithmetic", "--out", "x", "--n", "0"], "--n"),
        (["preprocess", "gsm8k", "--out", "x", "--test-fraction", "1.5"], "--test-fraction"),
        (["init-model", "--out", "x", "--vocab-size", "0"], "--vocab-size"),
        (["demo", "--ppo-steps", "-1"], "--ppo-steps"),
    ],
)
def test_bad_flag_values_exit_2_with_one_line(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit_code(argv, capsys)
    assert code == 2, err
    assert words in err, err


def test_local_files_that_cannot_be_read_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reward and rollout clients: a missing input, an unwritable output, a TLS file
    that is not there or a token variable that is not set, before any call."""
    missing = tmp_path / "missing.jsonl"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"data_source": "openai/gsm8k", "response": "#### 1", "ground_truth": "1"}\n')
    monkeypatch.delenv("RLFLEET_NO_SUCH_TOKEN", raising=False)
    base = ["reward", "score", "--addr", "127.0.0.1:1", "--timeout-s", "1"]
    for argv, words in [
        ([*base, "--input", str(missing)], f"--input {missing}: cannot read it"),
        ([*base, "--input", str(rows), "--out", str(tmp_path / "no" / "o.jsonl")], "--out"),
        ([*base, "--input", str(rows), "--tls-ca", str(tmp_path / "ca.pem")], "--tls-ca"),
        (
            [*base, "--input", str(rows), "--auth-token-env", "RLFLEET_NO_SUCH_TOKEN"],
            "$RLFLEET_NO_SUCH_TOKEN is not set",
        ),
        (
            ["rollout", "generate", "--addr", "127.0.0.1:1", "--prompts", str(missing)],
            f"--prompts {missing}: cannot read it",
        ),
    ]:
        code, err = _exit_code(argv, capsys)
        assert code == 2, (argv, err)
        assert words in err, err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("content", [b"{not json", b"[]", b"\xff\xfe", b'{"processes": [1]}'])
def test_a_broken_cluster_state_file_is_one_line(
    content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """status, scale and down on a state file that `rlfleet up` did not write (or that
    was cut short): one line naming it, exit 2."""
    (tmp_path / "cluster.json").write_bytes(content)
    for argv in (
        ["status", "--state-dir", str(tmp_path)],
        ["scale", "rollout", "2", "--state-dir", str(tmp_path)],
        ["down", "--state-dir", str(tmp_path)],
    ):
        code, err = _exit_code(argv, capsys)
        assert code == 2, (argv, err)
        assert "cluster.json" in err and len(err.strip().splitlines()) == 1, err


def test_serve_rollout_refuses_a_cuda_device_this_machine_lacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    code, err = _exit_code(
        ["serve", "rollout", "--insecure", "--model", "m", "--device", "cuda:7"], capsys
    )
    assert code == 2 and "--device cuda:7: this machine has no CUDA device" in err
    code, err = _exit_code(
        ["serve", "rollout", "--insecure", "--model", "m", "--device", "tpu"], capsys
    )
    assert code == 2 and "--device must be cpu, cuda or cuda:N, got 'tpu'" in err


def test_serve_trainer_takes_overrides_as_every_service_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _exit_code(
        ["serve", "trainer", "--insecure", "--config", str(EXAMPLE), "-o", "actor.lr=nope"], capsys
    )
    assert code == 2 and "actor.lr" in err and "'nope'" in err


def test_demo_checks_its_overrides_before_building_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    code, err = _exit_code(["demo", "--out", str(out), "--set", "notakey=1"], capsys)
    assert code == 2 and "rlfleet demo: notakey: in overrides: unknown key" in err
    assert not out.exists()  # no model, no data, no warm start


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("actor.lr=inf", "actor.lr: Input should be a finite number"),
        ("actor.lr=.inf", "actor.lr: Input should be a finite number"),
        ("actor.entropy_coeff=.nan", "actor.entropy_coeff: Input should be a finite number"),
        ("reward.sample_timeout_s=.inf", "reward.sample_timeout_s"),
        ("actor.lr=true", "actor.lr: expected a number, not a boolean"),
        ("data.train_batch_size=true", "data.train_batch_size: expected a number, not a boolean"),
        ("rollout.openai.port=true", "rollout.openai.port: expected a number"),
        ("rollout.openai.port=99999", "rollout.openai.port"),
    ],
)
def test_config_numbers_are_finite_numbers(override: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [override])
    assert words in info.value.lines(""), info.value.lines("")


def test_config_booleans_and_numbers_still_load() -> None:
    cfg = load_config(EXAMPLE, ["actor.use_kl_loss=true", "actor.lr=1", "rollout.temperature=1"])
    assert cfg.actor.use_kl_loss is True and cfg.actor.lr == 1.0


def test_a_verl_override_on_an_rlfleet_config_names_the_key_to_use() -> None:
    """Translating would read the whole rlfleet file as verl's (six unrelated errors);
    instead one line per verl override, with rlfleet's key for it."""
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "examples" / "ppo_gsm8k.yaml", ["actor_rollout_ref.rollout.n=4"])
    assert [str(i) for i in info.value.issues] == [
        "actor_rollout_ref.rollout.n: a verl key, on a config in rlfleet's layout; "
        "use rollout.n (got 'actor_rollout_ref.rollout.n=4')"
    ]


def test_a_verl_config_takes_rlfleets_jsonl_logger() -> None:
    verl = ROOT / "tests" / "fixtures" / "verl" / "ppo_trainer.yaml"
    if not verl.is_file():
        pytest.skip(f"no verl fixture at {verl}")
    cfg = load_config(verl, ["trainer.logger=[console,jsonl]", "trainer.nnodes=1"])
    assert cfg.trainer.logger == ["console", "jsonl"]


def test_train_without_a_config_reads_verl_overrides_on_verls_defaults(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """As `python -m verl.trainer.main_ppo key=value ...`: no --config, verl's keys on
    verl's defaults, checked before anything starts."""
    missing = tmp_path / "nowhere"
    code, err = _exit_code(
        ["train", f"actor_rollout_ref.model.path={missing}", f"data.train_files={missing}.pq"],
        capsys,
    )
    assert code == 2
    assert "rlfleet train: actor_rollout_ref.model.path: no such folder" in err, err
    assert f"rlfleet train: data.train_files: no such file (got '{missing}.pq')" in err
