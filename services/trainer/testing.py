"""Test helpers for the trainer: small configs, synthetic batches, a fake rollout replica.

Used by the trainer's tests and by the 2-rank check; kept in the package so that a
torchrun subprocess can import them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
import torch

from rlfleet.common.config import Config, config_from_dict
from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.batch import Batch
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc
from rlfleet.weightsync.wire import WeightStreamReceiver

__all__ = ["FakeRollout", "make_batch", "make_config", "make_varied_batch"]


def make_config(model_dir: str, overrides: Sequence[str] = (), **sections: Any) -> Config:
    """A config on ``model_dir`` for tests: lr 1e-3, 2 prompts x 2 responses per
    mini-batch (4 samples), seed 0.

    ``sections`` are merged into the top-level sections (e.g.
    ``algorithm={"adv_estimator": "grpo"}``); ``overrides`` are dotted ``key=value``.
    """
    raw: dict[str, Any] = {
        "data": {"train_batch_size": 2, "max_prompt_length": 8, "max_response_length": 8},
        "actor": {"model_path": model_dir, "lr": 1e-3, "ppo_mini_batch_size": 2},
        "rollout": {"n": 2},
        "critic": {"lr": 1e-3},
        "trainer": {"seed": 0},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, overrides)


def make_batch(
    bs: int = 4,
    prompt_len: int = 6,
    response_len: int = 5,
    *,
    vocab: int = 2048,
    seed: int = 0,
    pad_rows: int = 1,
) -> Batch:
    """A batch with left-padded prompts and right-padded responses (verl's layout).

    The first ``pad_rows`` rows have two prompt pad tokens and one response pad token.
    ``uid`` pairs rows (0,1), (2,3), ... into groups.
    """
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, vocab, (bs, prompt_len), generator=g)
    resp = torch.randint(5, vocab, (bs, response_len), generator=g)
    am = torch.ones(bs, prompt_len + response_len, dtype=torch.int64)
    am[:pad_rows, :2] = 0
    am[:pad_rows, -1] = 0
    prompt[:pad_rows, :2] = 0
    resp[:pad_rows, -1] = 0
    return {
        "input_ids": torch.cat([prompt, resp], dim=1),
        "attention_mask": am,
        "responses": resp,
        "uid": [f"p{i // 2}" for i in range(bs)],
    }


def make_varied_batch(
    bs: int = 8,
    prompt_len: int = 12,
    response_len: int = 10,
    *,
    vocab: int = 2048,
    seed: int = 0,
) -> Batch:
    """A batch in verl's layout whose rows all differ in length: prompts of 1 to
    ``prompt_len`` tokens (left-padded), responses of 1 to ``response_len`` (right-padded),
    pad id 0. ``uid`` pairs rows (0,1), (2,3), ..."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt_len + 1, (bs,), generator=g)
    response_lens = torch.randint(1, response_len + 1, (bs,), generator=g)
    cols = torch.arange(prompt_len + response_len)
    am = (cols >= prompt_len - prompt_lens[:, None]) & (cols < prompt_len + response_lens[:, None])
    ids = torch.randint(5, vocab, (bs, prompt_len + response_len), generator=g) * am
    return {
        "input_ids": ids,
        "attention_mask": am.to(torch.int64),
        "responses": ids[:, prompt_len:].clone(),
        "uid": [f"p{i // 2}" for i in range(bs)],
    }


class FakeRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """A rollout replica that only takes weights: assembles every ``UpdateWeights``
    stream with :class:`~rlfleet.weightsync.wire.WeightStreamReceiver` and keeps the
    tensors of the last complete update, checked against ``expected`` names/shapes."""

    def __init__(self, expected: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.expected = dict(expected or {})
        self.weights: dict[str, torch.Tensor] = {}
        self.version = 0
        self.updates = 0
        self.buckets_seen: list[int] = []
        self.lock = threading.Lock()

    def UpdateWeights(
        self, request_iterator: Iterator[rollout_pb2.WeightChunk], context: grpc.ServicerContext
    ) -> rollout_pb2.UpdateWeightsResponse:
        receiver = WeightStreamReceiver()
        version, tensors = receiver.receive((c.version, c.chunk) for c in request_iterator)
        if self.expected:
            missing = sorted(set(self.expected) - set(tensors))
            if missing:
                raise InvalidArgument(f"missing tensors {missing[:3]}", field="weights")
            for name, t in tensors.items():
                if tuple(t.shape) != tuple(self.expected[name]):
                    raise InvalidArgument(f"{name}: shape {tuple(t.shape)}", field=name)
        with self.lock:
            self.weights = dict(tensors)
            self.version = version
            self.updates += 1
            self.buckets_seen.append(receiver.buckets)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return rollout_pb2.UpdateWeightsResponse(
            version=version, bytes=nbytes, tensors=len(tensors)
        )
