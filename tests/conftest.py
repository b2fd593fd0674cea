"""Session-wide test setup: offline Hugging Face, and the tiny model built once.

Heavy imports happen inside fixtures, so torch-free tests still collect and run
without torch installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Set at import, before any test module can import transformers / huggingface_hub,
# which read these once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Ray clusters started by tests run on loopback only (Ray reads this at import: with it
# off, a node with no address given takes 127.0.0.1 instead of the host's interface).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session", autouse=True)
def _offline_hub() -> Iterator[None]:
    """Keep the session offline even if a test changed the environment."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model + tokenizer folder (seed 0), built once per session (~0.2 s)."""
    from rlfleet.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module", autouse=True)
def _process_security_per_module() -> Iterator[None]:
    """The process's default security (servers' and channels' credentials) is global;
    whatever a module's tests or fixtures set is undone when the module ends."""
    from rlfleet.common.rpc import current_security, set_security

    before = current_security()
    yield
    set_security(before)


@pytest.fixture(autouse=True)
def _process_security_per_test() -> Iterator[None]:
    from rlfleet.common.rpc import current_security, set_security

    before = current_security()
    yield
    set_security(before)


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a few supervised steps on one fixed conversation: it calls
    the calculator on ``6 * 7`` and then answers ``#### 42``, whatever the prompt.
    Enough for multi-turn rollouts to have tool turns (built once per session)."""
    from rlfleet.launch.agentic_demo import fixed_call_model

    return fixed_call_model(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny-tools")
