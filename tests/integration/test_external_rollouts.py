"""``trainer.rollout_source: external``: PPOTrainer trains on sessions an agent ran through a
rollout replica's OpenAI endpoint with the official ``openai`` client.

The replica is a real gRPC + HTTP server on 127.0.0.1 with authentication on; the
trainer runs in this process; the driver takes finished sessions over
``PopTrajectories`` with the driver's credentials and pushes weights back over gRPC.
The agent produces one step's sessions, waits for that step to train, then produces
the next, so the second step's sessions are sampled with the weights the first step
pushed.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

import numpy as np
import openai

from rlfleet.common.auth import credential_set, generate_tokens
from rlfleet.common.config import load_config
from rlfleet.common.rpc import Security, using_security
from rlfleet.driver.clients import Role, in_process_workers
from rlfleet.driver.external import RemoteTrajectorySource
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.openai_server import load_tokenizer, openai_url, start_openai_server
from rlfleet.rollout.server import start_rollout_server
from rlfleet.rollout.trajectories import Trajectory, TrajectoryStore

pytestmark = pytest.mark.timeout(600)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
SESSIONS_PER_STEP = 4


class Recording:
    """A trajectory source that remembers what each pop returned."""

    def __init__(self, inner: RemoteTrajectorySource) -> None:
        self.inner = inner
        self.name = inner.name
        self.popped: list[Trajectory] = []

    def pop(self, max_sessions: int) -> list[Trajectory]:
        got = self.inner.pop(max_sessions)
        self.popped += got
        return got

    def close(self) -> None:
        self.inner.close()


@pytest.fixture()
def served(tiny_model_dir: Path) -> Iterator[tuple[str, str, dict[str, str], RolloutCore]]:
    tokens = generate_tokens()
    security = Security(credentials=credential_set(tokens)["rollout"])
    core = RolloutCore(HFEngine(tiny_model_dir), replica_id="agent-replica")
    store = TrajectoryStore()
    with using_security(security):
        server = start_rollout_server(core, trajectories=store)
    endpoint = start_openai_server(
        core, load_tokenizer(str(tiny_model_dir)), store, security=security
    )
    try:
        yield server.address, openai_url(endpoint, "127.0.0.1"), tokens, core
    finally:
        endpoint.stop()
        server.stop(0)
        core.close()


def agent(
    url: str, key: str, steps: int, trained: list[threading.Event], log: dict[str, Any]
) -> None:
    """Two tasks per step, two sessions each (a GRPO group); reward: characters written."""
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)
    for step in range(steps):
        for task in range(SESSIONS_PER_STEP // 2):
            a, b = 3 * step + task, 7 - task
            for k in range(2):
                sid = f"step{step}-task{task}-{k}"
                out = client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                    max_tokens=8,
                    temperature=1.0,
                    seed=100 * step + 10 * task + k,
                    extra_headers={"X-Session-Id": sid},
                )
                reward = len(out.choices[0].message.content or "") / 20.0
                log[sid] = {"reward": reward, "weight_version": out.weight_version}
                req = urllib.request.Request(
                    f"{url}/sessions/{sid}/reward",
                    data=json.dumps({"reward": reward, "group": f"step{step}-task{task}"}).encode(),
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                    method="POST",
                )
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert r.status == 200
        if step + 1 < steps and not trained[step].wait(timeout=300):
            return


def test_driver_trains_on_sessions_an_agent_ran_through_the_openai_endpoint(
    served: tuple[str, str, dict[str, str], RolloutCore], tiny_model_dir: Path, tmp_path: Path
) -> None:
    grpc_address, url, tokens, core = served
    cfg = load_config(
        EXAMPLE,
        [
            f"actor.model_path={tiny_model_dir}",
            f"trainer.default_local_dir={tmp_path}",
            "data.val_files=[]",
            "rollout.n=2",  # GRPO groups: the agent runs two sessions per task
            "rollout.temperature=1.0",
            "actor.ppo_mini_batch_size=2",  # x rollout.n: one mini-batch of 4 rows
            "actor.ppo_micro_batch_size=null",
            "ref.log_prob_micro_batch_size=null",
            "rollout.log_prob_micro_batch_size=null",
            "trainer.rollout_source=external",
            f"trainer.external.batch_size={SESSIONS_PER_STEP}",
            "trainer.external.poll_interval_s=0.05",
            "trainer.external.timeout_s=300",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.val_before_train=false",
            "trainer.resume_mode=disable",
            "trainer.logger=[jsonl]",
        ],
    )
    trained = [threading.Event(), threading.Event()]
    log: dict[str, Any] = {}

    def on_step(record: StepRecord) -> None:
        trained[record.step - 1].set()

    thread = threading.Thread(
        target=agent, args=(url, tokens["agent"], 2, trained, log), daemon=True
    )
    with using_security(Security(credentials=credential_set(tokens)["driver"])):
        source = Recording(RemoteTrajectorySource(grpc_address))
        mapping = {
            Role.ActorRolloutRef: in_process_workers()[Role.ActorRolloutRef],
            Role.Rollout: [grpc_address],  # no reward worker: the agent posts rewards
        }
        with PPOTrainer(
            config=cfg, role_worker_mapping=mapping, on_step=on_step, trajectory_sources=[source]
        ) as trainer:
            trainer.init_workers()
            thread.start()
            records = trainer.fit()
    thread.join(timeout=60)
    assert [r.step for r in records] == [1, 2]
    assert len(source.popped) == 2 * SESSIONS_PER_STEP
    for i, record in enumerate(records):
        m = record.metrics
        taken = source.popped[i * SESSIONS_PER_STEP : (i + 1) * SESSIONS_PER_STEP]
        assert {t.session_id for t in taken} == {s for s in log if s.startswith(f"step{i}-")}, (
            "each step trains on its own sessions"
        )
        assert m["external/sessions"] == SESSIONS_PER_STEP == m["external/rows"]
        rewards = [log[t.session_id]["reward"] for t in taken]
        assert m["critic/score/mean"] == pytest.approx(np.mean(rewards), abs=1e-6)
        lengths = [t.completions[0].token_ids.size for t in taken]
        assert m["response_length/mean"] == pytest.approx(np.mean(lengths), abs=1e-6)
        # The recorded log-probs were the old log-probs (no recompute), and they are the
        # trainer's own: the policy ratio before the update is 1.
        assert m["external/rollout_log_probs"] == 1.0 and "timing_s/old_log_prob" not in m
        assert abs(m["actor/ppo_kl"]) < 1e-4 and m["actor/pg_clipfrac"] == 0.0
        # Step 2's sessions were sampled after step 1 pushed its weights: version 1.
        assert m["rollout/weight_version"] == float(i) and m["staleness/max"] == 0.0
        assert all(log[t.session_id]["weight_version"] == i for t in taken)
    assert core.info().weight_version == 2  # both updates reached the replica
