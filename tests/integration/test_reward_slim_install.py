"""A reward-only install has no torch, and rule scoring's package imports there.

This builds a real virtualenv and installs `rlfleet[reward]` from this checkout,
the way a user who only wants the reward service would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_reward_extra_installs_without_torch(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{REPO}[reward]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.util, rlfleet.reward, rlfleet.common, rlfleet.v1.reward_pb2_grpc;"
            "print(importlib.util.find_spec('torch') is None)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout, so the installed package is what imports
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "True", "torch got installed by the reward extra"
    _serve_and_score(env_dir / "bin" / "rlfleet", tmp_path)


def _serve_and_score(rlfleet: Path, tmp_path: Path) -> None:
    """`rlfleet serve reward` and `rlfleet reward score` work in the torch-free install."""
    rows = tmp_path / "responses.jsonl"
    rows.write_text(
        json.dumps(
            {"data_source": "openai/gsm8k", "response": "2 + 3 = 5\n#### 5", "ground_truth": "5"}
        )
        + "\n"
        + json.dumps({"data_source": "openai/gsm8k", "response": "#### 6", "ground_truth": "5"})
        + "\n"
    )
    server = subprocess.Popen(
        [str(rlfleet), "serve", "reward", "--port", "0", "--metrics-port", "0", "--insecure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # the one-line JSON "serving" handshake
        assert line, server.stderr.read() if server.stderr else ""
        address = json.loads(line)["address"]
        scored = subprocess.run(
            [str(rlfleet), "reward", "score", "--addr", address, "--input", str(rows)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert scored.returncode == 0, scored.stderr
        scores = [json.loads(x)["score"] for x in scored.stdout.splitlines()]
        assert scores == [1.0, 0.0]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0


def test_reward_package_imports_with_torch_blocked() -> None:
    """Fast twin of the test above: the import graph never reaches torch."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import rlfleet, rlfleet.reward, rlfleet.common, rlfleet.cli\n"
        "import rlfleet.v1.reward_pb2_grpc\n"
        "assert 'torch' not in {m for m, v in sys.modules.items() if v is not None}\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
