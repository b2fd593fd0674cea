"""The services as fuzz targets: each a real server started in-process on
127.0.0.1 port 0 with authentication on, its valid examples, its own attacks, and
the normal request that must still work after a storm (see :mod:`fuzzlib`)."""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fuzzlib import (
    GENERIC,
    Budget,
    Credentials,
    Method,
    Request,
    Target,
    broken_chunk_stream,
    methods_of,
    model_dir_for,
    random_string,
    raw_channel,
    serving,
)
from google.protobuf import struct_pb2
from google.protobuf.message import Message

from rlfleet.v1 import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tools_pb2,
    tools_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

SERVICES = ("reward", "rollout", "trainer", "scheduler", "tools")


def _body(m: Any, msgs: list[Message]) -> bytes | list[bytes]:
    raw = [x.SerializeToString() for x in msgs]
    return raw if m.client_streaming else raw[0]


# ------------------------------------------------------------------------------ reward


def _sample(rng: random.Random) -> reward_pb2.RewardSample:
    answer = rng.randrange(100)
    return reward_pb2.RewardSample(
        id=f"s{rng.randrange(1000)}",
        data_source=rng.choice(["openai/gsm8k", "gsm8k", "math500"]),
        prompt="what is it?",
        response=f"so\n#### {answer}",
        ground_truth=struct_pb2.Value(string_value=str(rng.choice((answer, answer + 1)))),
    )


def _score_request(rng: random.Random) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(samples=[_sample(rng) for _ in range(rng.randrange(1, 4))])


def _nested_value(depth: int) -> struct_pb2.Value:
    v = struct_pb2.Value(string_value="leaf")
    for _ in range(depth):
        outer = struct_pb2.Value()
        outer.list_value.values.add().CopyFrom(v)
        v = outer
    return v


def gen_reward_samples(rng: random.Random, target: Target) -> Request:
    """Samples with huge text, NaN/Inf or deeply nested ground truths, many samples."""
    m = target.method(rng.choice(["Score", "ScoreStream"]))
    req = _score_request(rng)
    s = req.samples[0]
    kind = rng.choice(
        ["huge_text", "nan_truth", "nested", "many", "huge_extra", "names", "empty", "chat"]
    )
    if kind == "huge_text":
        setattr(s, rng.choice(["response", "prompt"]), "9" * rng.choice((1 << 20, (1 << 20) + 1)))
    elif kind == "nan_truth":
        s.ground_truth.number_value = rng.choice((math.nan, math.inf, -math.inf, 1e308))
    elif kind == "nested":
        s.ground_truth.CopyFrom(_nested_value(rng.choice((10, 30, 60, 95, 150))))
    elif kind == "many":
        for _ in range(rng.choice((600, 2000))):
            req.samples.add().CopyFrom(s)
    elif kind == "huge_extra":
        for i in range(rng.choice((10, 5000))):
            s.extra_info.fields[f"k{i}"].string_value = "v" * rng.choice((1, 1000))
    elif kind == "names":
        s.data_source = random_string(rng)
        s.id = random_string(rng)
    elif kind == "empty":
        req.ClearField("samples")
    elif kind == "chat":
        small = Budget(1 << 16)
        for _ in range(rng.choice((1, 3000))):
            s.prompt_messages.add(
                role=random_string(rng, budget=small), content=random_string(rng, budget=small)
            )
    msgs = [req] * (rng.choice((1, 2, 3)) if m.client_streaming else 1)
    return Request(m, f"reward:{kind}", _body(m, msgs))


@contextlib.contextmanager
def reward_target(creds: Credentials) -> Iterator[Target]:
    from rlfleet.common.config import RewardConfig
    from rlfleet.reward.server import start_reward_service

    config = RewardConfig(num_workers=2, sample_timeout_s=2.0)
    with serving(creds), start_reward_service(config, port=0) as service:
        address = service.address

        def check() -> None:
            with contextlib.closing(raw_channel(address)) as ch:
                stub = reward_pb2_grpc.RewardServiceStub(ch)
                sample = reward_pb2.RewardSample(
                    data_source="openai/gsm8k",
                    response="#### 42",
                    ground_truth=struct_pb2.Value(string_value="42"),
                )
                resp = stub.Score(reward_pb2.ScoreRequest(samples=[sample]), **creds.stub_kwargs())
                assert [r.score for r in resp.results] == [1.0], resp
                stub.GetInfo(reward_pb2.GetRewardInfoRequest(), **creds.stub_kwargs())

        yield Target(
            name="reward",
            address=address,
            tokens=creds.tokens,
            # ScoreStream without pack_results (the fuzz's requests mostly lack it)
            # answers one message per sample: a stream of 3 x 2,001 samples
            # takes 1.5 s alone, and four of them at once, with the fuzz client in this
            # process (one GIL), took up to 16 s on a 2-vCPU AMD EPYC VM.
            methods=methods_of(
                reward_pb2, "RewardService", deadline_s=20.0, deadlines={"ScoreStream": 45.0}
            ),
            examples={
                "Score": lambda rng: [_score_request(rng)],
                "ScoreStream": lambda rng: [_score_request(rng) for _ in range(rng.randrange(4))],
                "GetInfo": lambda rng: [reward_pb2.GetRewardInfoRequest()],
            },
            generators=[*GENERIC, (gen_reward_samples, 3.0)],
            check=check,
        )


# ----------------------------------------------------------------------------- rollout


def _weight_stream(
    tensors: dict[str, Any], version: int, *, bucket: int = 0, final: bool = True, n: int = 0
) -> list[rollout_pb2.WeightChunk]:
    from rlfleet.common.codec.wire import iter_chunks
    from rlfleet.weightsync.wire import bucket_meta

    meta = bucket_meta(version, bucket, final=final, tensors=n or len(tensors))
    # Chunks of 256 KiB, or larger where a hostile name (up to a million characters
    # and more) would leave a piece header no room for data.
    longest = max((len(k.encode()) for k in tensors), default=0)
    return [
        rollout_pb2.WeightChunk(version=version, chunk=c)
        for c in iter_chunks(tensors, meta, max_chunk_bytes=max(1 << 18, 2 * longest + 4096))
    ]


def _hostile_weights(rng: random.Random, weights: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A copy of some weights with hostile values or names."""
    import torch

    names = sorted(weights)
    pick = rng.sample(names, k=min(len(names), rng.choice((1, 3, len(names)))))
    out = {k: weights[k].clone() for k in pick}
    k = rng.choice(pick)
    kind = rng.choice(["nan", "inf", "zeros", "huge", "shape", "dtype", "unknown", "empty"])
    if kind == "nan":
        out[k].view(-1)[rng.randrange(out[k].numel())] = math.nan
    elif kind == "inf":
        out[k].view(-1)[0] = rng.choice((math.inf, -math.inf))
    elif kind == "zeros":
        out = {n: torch.zeros_like(t) for n, t in out.items()}
    elif kind == "huge":
        out[k].fill_(3.0e38)
    elif kind == "shape":
        out[k] = torch.zeros(rng.choice(((1,), (3, 5), (out[k].numel() + 1,), (0,))))
    elif kind == "dtype":
        out[k] = out[k].to(rng.choice((torch.float64, torch.int64, torch.bfloat16, torch.bool)))
    elif kind == "unknown":
        out[random_string(rng) or "x"] = torch.zeros(4)
    elif kind == "empty":
        out = {}
    return kind, out


def gen_weight_attack(rng: random.Random, target: Target) -> Request:
    """UpdateWeights streams with hostile values, broken chunks, duplicated buckets or
    tensor names, wrong or leaping versions."""
    state = target.state
    m = target.method("UpdateWeights")
    version = state["version"]() + 1
    weights: dict[str, Any] = state["weights"]
    kind = rng.choice(["values", "chunks", "dup_bucket", "dup_name", "version", "buckets"])
    if kind == "values":
        what, tensors = _hostile_weights(rng, weights)
        stream = _weight_stream(tensors, version) if tensors else []
        kind = f"values:{what}"
    elif kind == "chunks":
        stream = _weight_stream(weights, version)
        what, chunks = broken_chunk_stream([c.chunk for c in stream], rng)
        stream = [rollout_pb2.WeightChunk(version=version, chunk=c) for c in chunks]
        kind = f"chunks:{what}"
    elif kind == "dup_bucket":
        names = sorted(weights)
        half = {n: weights[n] for n in names[: len(names) // 2]}
        rest = {n: weights[n] for n in names[len(names) // 2 :]}
        stream = _weight_stream(half, version, bucket=0, final=False)
        stream += _weight_stream(rest, version, bucket=0, final=True, n=len(names))
    elif kind == "dup_name":
        names = sorted(weights)
        half = {n: weights[n] for n in names[: len(names) // 2]}
        stream = _weight_stream(half, version, bucket=0, final=False)
        stream += _weight_stream(weights, version, bucket=1, final=True, n=len(names))
    elif kind == "version":
        v = rng.choice((0, version - 1, version + 10_000, 2**64 - 1, 2**63))
        stream = _weight_stream(weights, v)
        if stream and rng.random() < 0.5:
            stream[-1].version = version  # versions differ within the stream
        kind = f"version:{v}"
    else:  # bucket meta: gaps, garbage, tensors count
        names = sorted(weights)
        first = {n: weights[n] for n in names[:2]}
        stream = _weight_stream(first, version, bucket=rng.choice((1, 2**40)), final=False)
        stream += _weight_stream(
            {n: weights[n] for n in names[2:]}, version, bucket=1, final=True, n=rng.randrange(99)
        )
    return Request(m, f"weights:{kind}", [c.SerializeToString() for c in stream])


def gen_offer_attack(rng: random.Random, target: Target) -> Request:
    """OpenWeightTransfer offers: huge or inconsistent sizes, duplicate names,
    unknown tensors and dtypes, bucket games; commits and aborts of unknown ids."""
    version = target.state["version"]() + 1
    specs: list[rollout_pb2.TensorSpec] = list(target.state["specs"])
    kind = rng.choice(["huge", "dup", "mismatch", "unknown", "bucket", "commit", "abort"])
    offer = rollout_pb2.WeightTransferOffer(
        version=version,
        tensors=specs,
        total_bytes=target.state["total_bytes"],
        transports=[rollout_pb2.WEIGHT_TRANSPORT_TCP],
        sender_host="127.0.0.1",
    )
    if kind == "huge":
        offer.tensors[0].shape[:] = rng.choice(([2**62], [2**31, 2**31], [2**40]))
        offer.total_bytes = rng.choice((2**64 - 1, 2**62, 1 << 40))
    elif kind == "dup":
        offer.tensors.add().CopyFrom(offer.tensors[rng.randrange(len(specs))])
    elif kind == "mismatch":
        offer.total_bytes = rng.choice((0, 1, offer.total_bytes + 1, offer.total_bytes - 1))
    elif kind == "unknown":
        t = offer.tensors[rng.randrange(len(specs))]
        t.name, t.dtype = random_string(rng), rng.choice((0, 99, common_pb2.COMPLEX128))
    elif kind == "bucket":
        offer.bucket = rng.choice((1, 2**32 - 1))
        offer.more_buckets = True
        offer.update_id = random_string(rng)
    if kind == "commit":
        m = target.method("CommitWeightTransfer")
        msg: Message = rollout_pb2.WeightTransferCommit(
            transfer_id=random_string(rng), crc32c=[rng.randrange(2**32) for _ in range(3)]
        )
    elif kind == "abort":
        m = target.method("AbortWeightTransfer")
        msg = rollout_pb2.AbortWeightTransferRequest(
            update_id=random_string(rng), reason=random_string(rng)
        )
    else:
        m = target.method("OpenWeightTransfer")
        msg = offer
    return Request(m, f"offer:{kind}", msg.SerializeToString())


def _generate_request(rng: random.Random) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=f"r{rng.randrange(1000)}",
        prompts=[
            rollout_pb2.Prompt(id=str(i), token_ids=[rng.randrange(5, 2048) for _ in range(4)])
            for i in range(rng.randrange(1, 3))
        ],
        sampling=rollout_pb2.SamplingParams(
            n=rng.choice((1, 2)),
            temperature=rng.choice((0.0, 1.0)),
            max_tokens=rng.choice((1, 4)),
            logprobs=rng.random() < 0.5,
            detokenize=rng.random() < 0.5,
        ),
    )


@contextlib.contextmanager
def rollout_target(creds: Credentials, model_dir: Path) -> Iterator[Target]:
    from rlfleet.common.codec.batch import tensor_specs
    from rlfleet.rollout.core import RolloutCore
    from rlfleet.rollout.engine import GenerateLimits
    from rlfleet.rollout.hf_engine import HFEngine
    from rlfleet.rollout.server import start_rollout_server

    engine = HFEngine(model_dir)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    # What an operator of a shared replica sets (--max-n ... --max-new-tokens), so
    # that no single request is legitimately long on a CPU.
    limits = GenerateLimits(
        max_n=4, max_prompts=8, max_samples=16, max_new_tokens=16, max_request_tokens=2048
    )
    core = RolloutCore(engine, replica_id="fuzz", limits=limits, transfer_timeout_s=5.0)
    # The OpenAI endpoint's trajectory store (Get/PopTrajectories read it), with a few
    # sessions in it so that the storm's calls find some.
    from rlfleet.rollout.engine import FinishReason
    from rlfleet.rollout.trajectories import Completion, TrajectoryStore

    store = TrajectoryStore(max_sessions=64, max_tokens=1 << 14)

    def add_sessions(rng: random.Random, k: int = 3) -> list[str]:
        ids = []
        for _ in range(k):
            sid = f"fz-{rng.randrange(1 << 30)}"
            n = rng.randrange(1, 5)
            store.record(
                sid,
                Completion.of(
                    [5, 6, 7],
                    [8] * n,
                    [-0.5] * n,
                    weight_version=0,
                    finish_reason=FinishReason.STOP,
                    temperature=1.0,
                ),
            )
            if rng.random() < 0.7:
                store.finish(sid, rng.random())
            ids.append(sid)
        return ids

    add_sessions(random.Random(0), 8)
    specs = [
        rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape))
        for s in tensor_specs(weights)
    ]
    with serving(creds):
        server = start_rollout_server(core, trajectories=store)
    address = server.address

    def version() -> int:
        return int(engine.info().weight_version)

    def check() -> None:
        with contextlib.closing(raw_channel(address)) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            kw = creds.stub_kwargs()
            stub.WakeUp(rollout_pb2.WakeUpRequest(), **kw)
            status = stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), **kw)
            v = status.weight_version + 1
            stub.UpdateWeights(iter(_weight_stream(weights, v)), **kw)
            req = rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(id="p", token_ids=[5, 6, 7])],
                sampling=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            )
            results = list(stub.Generate(req, **kw))
            assert len(results) == 1 and len(results[0].token_ids) == 3, results
            assert results[0].weight_version == v, (results[0].weight_version, v)
            sid = add_sessions(random.Random(v), 1)[0]
            got = stub.GetTrajectories(rollout_pb2.GetTrajectoriesRequest(session_ids=[sid]), **kw)
            assert [t.session_id for t in got.trajectories] == [sid], got

    try:
        target = Target(
            name="rollout",
            address=address,
            tokens=creds.tokens,
            methods=methods_of(
                rollout_pb2, "RolloutService", deadline_s=10.0, deadlines={"Generate": 30.0}
            ),
            examples={
                "Generate": lambda rng: [_generate_request(rng)],
                "UpdateWeights": lambda rng: list(_weight_stream(weights, version() + 1)),
                "OpenWeightTransfer": lambda rng: [
                    rollout_pb2.WeightTransferOffer(
                        version=version() + 1,
                        tensors=specs,
                        total_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
                        transports=[rollout_pb2.WEIGHT_TRANSPORT_TCP],
                    )
                ],
                "Sleep": lambda rng: [rollout_pb2.SleepRequest(level=rng.choice((1, 2)))],
                "WakeUp": lambda rng: [rollout_pb2.WakeUpRequest()],
                "GetStatus": lambda rng: [rollout_pb2.GetRolloutStatusRequest()],
                "GetTrajectories": lambda rng: [
                    rollout_pb2.GetTrajectoriesRequest(session_ids=add_sessions(rng, 2))
                ],
                "PopTrajectories": lambda rng: [
                    rollout_pb2.PopTrajectoriesRequest(max_sessions=rng.choice((0, 1, 5, 1 << 31)))
                ],
            },
            generators=[*GENERIC, (gen_weight_attack, 3.0), (gen_offer_attack, 1.5)],
            check=check,
        )
        target.state.update(
            version=version,
            weights=weights,
            specs=specs,
            total_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
        )
        yield target
    finally:
        server.stop(0)
        core.close()


# ----------------------------------------------------------------------------- trainer

_FLOAT_KEYS = ("old_log_probs", "ref_log_prob", "values", "advantages", "returns")


def _ppo_batch(rng: random.Random, bs: int = 4) -> dict[str, Any]:
    import torch

    from rlfleet.trainer.testing import make_batch

    batch = make_batch(bs, 6, 5, seed=rng.randrange(1000))
    resp_len = batch["responses"].shape[1]
    g = torch.Generator().manual_seed(rng.randrange(1000))
    for k in _FLOAT_KEYS:
        batch[k] = torch.randn(bs, resp_len, generator=g) * 0.1 - (1.0 if "log" in k else 0.0)
    batch["token_level_rewards"] = torch.zeros(bs, resp_len)
    batch["response_mask"] = batch["attention_mask"][:, -resp_len:].clone()
    return batch


def _chunks(
    batch: dict[str, Any], max_chunk_bytes: int = 1 << 11
) -> list[common_pb2.TensorBatchChunk]:
    from rlfleet.common.codec.wire import iter_chunks

    # Larger chunks where a hostile key would leave a piece header no room for data.
    longest = max((len(str(k).encode()) for k in batch), default=0)
    return list(iter_chunks(batch, max_chunk_bytes=max(max_chunk_bytes, 2 * longest + 4096)))


def _hostile_batch(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A PPO batch with one hostile value, shape or dtype (encoded validly)."""
    import torch

    batch = _ppo_batch(rng)
    kind = rng.choice(
        [
            "nan",
            "inf",
            "huge_float",
            "token_range",
            "mask_values",
            "shape",
            "dtype",
            "empty",
            "wide",
            "rank",
            "uid",
            "drop_key",
            "extra",
        ]
    )
    if kind in ("nan", "inf", "huge_float"):
        k = rng.choice((*_FLOAT_KEYS, "token_level_rewards"))
        value = {"nan": math.nan, "inf": rng.choice((math.inf, -math.inf)), "huge_float": 3e38}
        batch[k].view(-1)[rng.randrange(batch[k].numel())] = value[kind]
        kind = f"{kind}:{k}"
    elif kind == "token_range":
        k = rng.choice(("input_ids", "responses"))
        batch[k].view(-1)[0] = rng.choice((-1, 2048, 2**62, -(2**63)))
    elif kind == "mask_values":
        k = rng.choice(("attention_mask", "response_mask"))
        batch[k].view(-1)[0] = rng.choice((2, -1, 255))
    elif kind == "shape":
        k = rng.choice(sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)))
        batch[k] = batch[k][: rng.choice((0, 1, 3))]
    elif kind == "dtype":
        k = rng.choice(sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)))
        batch[k] = batch[k].to(rng.choice((torch.float16, torch.int8, torch.bool, torch.float64)))
    elif kind == "empty":
        batch = {k: v[:0] if isinstance(v, torch.Tensor) else [] for k, v in batch.items()}
    elif kind == "wide":  # a long sequence, within the request byte limit
        batch = _ppo_batch(rng, bs=1)
        batch["input_ids"] = torch.randint(5, 2048, (1, rng.choice((2049, 4000))))
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    elif kind == "rank":
        k = rng.choice(("input_ids", "attention_mask", "advantages"))
        batch[k] = batch[k].reshape(-1) if rng.random() < 0.5 else batch[k][None]
    elif kind == "uid":
        batch["uid"] = rng.choice(([], ["x"] * 99, [random_string(rng)] * 4, [None] * 4))
    elif kind == "drop_key":
        del batch[rng.choice(sorted(batch))]
    elif kind == "extra":
        batch[random_string(rng) or "x"] = torch.zeros(rng.choice((0, 3, 100)))
    return kind, batch


def _stream_messages(m: Method, chunks: Sequence[Message]) -> list[Message]:
    """``chunks`` as ``m`` takes them: TrainStep wraps each in a TrainStepRequest."""
    if m.request is trainer_pb2.TrainStepRequest:
        return [trainer_pb2.TrainStepRequest(chunk=c) for c in chunks]
    return list(chunks)


def gen_batch_attack(rng: random.Random, target: Target) -> Request:
    """Trainer batch streams: hostile tensor values, shapes and dtypes, broken chunks."""
    streams = [m for m in target.methods if m.client_streaming]
    m = rng.choice(streams)
    if rng.random() < 0.5:
        kind, batch = _hostile_batch(rng)
        try:
            chunks = _chunks(batch)
        except (ValueError, TypeError) as e:  # the client codec refuses it: send raw
            chunks = [common_pb2.TensorBatchChunk(stream_id="x", last=True, meta={"e": str(e)})]
        body = [c.SerializeToString() for c in _stream_messages(m, chunks)]
        return Request(m, f"batch:{kind}", body)
    kind, chunks = broken_chunk_stream(_chunks(_ppo_batch(rng)), rng)
    body = [c.SerializeToString() for c in _stream_messages(m, chunks)]
    return Request(m, f"chunks:{kind}", body)


def gen_push_attack(rng: random.Random, target: Target) -> Request:
    """PushWeights: duplicate, dead or unknown targets, extreme versions and buckets."""
    m = target.method("PushWeights")
    n = rng.choice((1, 2, 3))
    addr = rng.choice(("127.0.0.1:1", "127.0.0.1:0", "[::1]:1", ""))
    req = trainer_pb2.PushWeightsRequest(
        targets=[trainer_pb2.RolloutTarget(replica_id=random_string(rng), address=addr)] * n,
        version=rng.choice((0, 1, 2**64 - 1)),
        bucket_bytes=rng.choice((0, 1, 2**64 - 1, 1 << 10)),
        transports=rng.choice(([], [1, 1], [99], [2, 3, 4, 5], [-1])),
    )
    return Request(m, "push", req.SerializeToString())


@contextlib.contextmanager
def trainer_target(creds: Credentials, model_dir: Path, run_dir: Path) -> Iterator[Target]:
    from rlfleet.common.rpc import create_server
    from rlfleet.trainer.core import TrainerCore
    from rlfleet.trainer.servicer import TrainerServicer
    from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server
    from rlfleet.trainer.testing import make_batch, make_config

    cfg = make_config(
        str(model_dir),
        algorithm={"adv_estimator": "gae"},
        actor={"ppo_micro_batch_size": 2},
        trainer={"default_local_dir": str(run_dir), "max_request_bytes": 1 << 20},
    )
    core = TrainerCore(cfg)
    with serving(creds):
        server = create_server([(trainer_add_to_server, TrainerServicer(core))])
    address = server.address

    def check() -> None:
        from rlfleet.common.codec.wire import ChunkAssembler

        with contextlib.closing(raw_channel(address)) as ch:
            stub = trainer_pb2_grpc.TrainerServiceStub(ch)
            kw = creds.stub_kwargs()
            batch = make_batch(4, 6, 5)
            asm = ChunkAssembler()
            for c in stub.ComputeLogProb(iter(_chunks(batch, 1 << 20)), **kw):
                asm.add(c)
            values, _ = asm.result()
            assert tuple(values["old_log_probs"].shape) == (4, 5), values.keys()
            stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), **kw)

    def stream_example_of(m: Method) -> Callable[[random.Random], list[Message]]:
        return lambda rng: _stream_messages(m, _chunks(_ppo_batch(rng)))

    streams = {m.short: stream_example_of(m) for m in methods_of(trainer_pb2, "TrainerService")}
    examples = {k: v for k, v in streams.items() if k not in _TRAINER_UNARY}
    examples.update(
        SaveCheckpoint=lambda rng: [
            trainer_pb2.SaveCheckpointRequest(path=rng.choice(("", "fuzz")), step=1)
        ],
        LoadCheckpoint=lambda rng: [trainer_pb2.LoadCheckpointRequest(path="")],
        PushWeights=lambda rng: [
            trainer_pb2.PushWeightsRequest(
                targets=[trainer_pb2.RolloutTarget(replica_id="r", address="127.0.0.1:1")]
            )
        ],
        SetLRScale=lambda rng: [
            trainer_pb2.SetLRScaleRequest(
                role=rng.choice(("actor", "critic", "ref", "")),
                scale=rng.choice((0.5, 1.0, 0.0, -1.0, 2.0, float("nan"), float("inf"))),
            )
        ],
        GetStatus=lambda rng: [trainer_pb2.GetTrainerStatusRequest()],
    )
    try:
        yield Target(
            name="trainer",
            address=address,
            tokens=creds.tokens,
            methods=methods_of(
                trainer_pb2,
                "TrainerService",
                deadline_s=30.0,
                deadlines={"GetStatus": 10.0},
                # Pushing to replicas that do not answer waits out their connection
                # retries, one target after another.
                long=("PushWeights",),
            ),
            examples=examples,
            generators=[*GENERIC, (gen_batch_attack, 5.0), (gen_push_attack, 0.5)],
            check=check,
        )
    finally:
        server.stop(0)


_TRAINER_UNARY = ("SaveCheckpoint", "LoadCheckpoint", "PushWeights", "SetLRScale", "GetStatus")


# --------------------------------------------------------------------------- scheduler


def _service_info(rng: random.Random) -> scheduler_pb2.ServiceInfo:
    return scheduler_pb2.ServiceInfo(
        role=rng.choice((scheduler_pb2.ROLE_ROLLOUT, scheduler_pb2.ROLE_REWARD)),
        address="127.0.0.1:1",
        node="n0",
        devices=[scheduler_pb2.Device(kind="cpu", index=0)],
        capabilities={"engine": "hf"},
        capacity=4,
    )


def gen_plan_attack(rng: random.Random, target: Target) -> Request:
    """Plan with huge or many pools, unknown pools and roles; registry floods."""
    kind = rng.choice(["huge_pool", "many_nodes", "unknown", "flood"])
    if kind == "flood":
        m = target.method("Register")
        info = _service_info(rng)
        info.capabilities.update({f"c{i}": "v" * 100 for i in range(rng.choice((10, 2000)))})
        info.devices.extend(
            scheduler_pb2.Device(kind="cuda", index=i, memory_bytes=2**64 - 1)
            for i in range(rng.choice((1, 5000)))
        )
        msg: Message = scheduler_pb2.RegisterRequest(info=info)
        return Request(m, "plan:flood", msg.SerializeToString())
    m = target.method("Plan")
    msg = scheduler_pb2.PlanRequest(mapping={"actor": "p", "rollout": "p", "reward_model": "q"})
    if kind == "huge_pool":
        msg.resource_pools["p"].gpus_per_node.extend(rng.choice(([2**32 - 1], [2**31] * 4, [0])))
    elif kind == "many_nodes":
        msg.resource_pools["p"].gpus_per_node.extend([8] * rng.choice((1000, 100_000)))
    else:
        msg.resource_pools[random_string(rng)].gpus_per_node.append(1)
        msg.mapping[random_string(rng)] = random_string(rng)
    return Request(m, f"plan:{kind}", msg.SerializeToString())


@contextlib.contextmanager
def scheduler_target(creds: Credentials) -> Iterator[Target]:
    from rlfleet.scheduler.placement import Device, NodeInventory
    from rlfleet.scheduler.registry import Registry, SchedulerCore
    from rlfleet.scheduler.server import start_scheduler_server

    node = NodeInventory("n0", (Device("cpu", 0), Device("cpu", 1)))
    core = SchedulerCore(
        Registry(heartbeat_interval_s=1.0, missed_heartbeats=3), device="cpu", nodes=[node]
    )
    with serving(creds):
        server = start_scheduler_server(core, probe_interval_s=0.5)
    address = server.address

    def check() -> None:
        with contextlib.closing(raw_channel(address)) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            kw = creds.stub_kwargs()
            # An address no hostile request uses (a registration at the address of
            # an entry takes that entry over).
            info = scheduler_pb2.ServiceInfo(
                role=scheduler_pb2.ROLE_ROLLOUT, address="127.0.0.1:7", node="n0"
            )
            sid = stub.Register(scheduler_pb2.RegisterRequest(info=info), **kw).service_id
            listed = stub.ListServices(scheduler_pb2.ListServicesRequest(), **kw)
            assert sid in [e.info.service_id for e in listed.services], (sid, listed)
            stub.GetTrainingStatus(scheduler_pb2.GetTrainingStatusRequest(), **kw)

    examples: dict[str, Any] = {
        "Register": lambda rng: [scheduler_pb2.RegisterRequest(info=_service_info(rng))],
        "Heartbeat": lambda rng: [
            scheduler_pb2.HeartbeatRequest(
                service_id=f"rollout-{rng.randrange(1, 5)}",
                load=scheduler_pb2.ServiceLoad(queue_depth=1, tokens_per_second=2.0),
            )
        ],
        "Deregister": lambda rng: [
            scheduler_pb2.DeregisterRequest(service_id=f"reward-{rng.randrange(1, 5)}")
        ],
        "ListServices": lambda rng: [scheduler_pb2.ListServicesRequest(role=rng.randrange(5))],
        "Plan": lambda rng: [
            scheduler_pb2.PlanRequest(
                resource_pools={"p": scheduler_pb2.Pool(gpus_per_node=[2])},
                mapping={"actor": "p", "rollout": "p"},
            )
        ],
        "GetPlacement": lambda rng: [scheduler_pb2.GetPlacementRequest()],
        "GetTrainingStatus": lambda rng: [scheduler_pb2.GetTrainingStatusRequest()],
        "SetTrainingStatus": lambda rng: [
            scheduler_pb2.TrainingStatus(global_step=1, total_steps=10, state="running")
        ],
    }
    try:
        yield Target(
            name="scheduler",
            address=address,
            tokens=creds.tokens,
            methods=methods_of(scheduler_pb2, "SchedulerService", deadline_s=10.0),
            examples=examples,
            generators=[*GENERIC, (gen_plan_attack, 1.0)],
            check=check,
        )
    finally:
        server.stop(0.0)


# ------------------------------------------------------------------------------- tools


def _call(rng: random.Random) -> tools_pb2.CallToolRequest:
    a, b = rng.randrange(1, 10**6), rng.randrange(1, 100)
    op = rng.choice("+-*/%")
    return tools_pb2.CallToolRequest(
        name="calculator",
        arguments_json=json.dumps({"expression": f"{a} {op} {b}"}),
        timeout_s=rng.choice((0.0, 5.0)),
        call_id=f"c{rng.randrange(1000)}",
    )


_HOSTILE_EXPRESSIONS = (
    "__import__('os').system('id')",
    "(lambda: 1)()",
    "9 ** 9 ** 9",
    "2 ** 100000",
    "10 ** 308 * 10.0",
    "1 / 0",
    "((((((((((((((((((((1))))))))))))))))))))",
    "(" * 300 + "1" + ")" * 300,
    "1" + " + 1" * 5000,
    "True + 1",
    "[1] * 10**9",
    "'a' * 10**9",
    "-" * 100000 + "1",
    "1e999",
)


def gen_tool_calls(rng: random.Random, target: Target) -> Request:
    """Hostile calls: expressions that try code, huge powers and nesting; arguments
    that are not objects, huge, deeply nested; unknown names; python programs that
    loop, fork and print without end; NaN and negative time-outs."""
    m = target.method("CallTool")
    req = _call(rng)
    kind = rng.choice(
        ["expression", "not_object", "huge_args", "nested", "name", "python", "timeout", "types"]
    )
    if kind == "expression":
        req.arguments_json = json.dumps({"expression": rng.choice(_HOSTILE_EXPRESSIONS)})
    elif kind == "not_object":
        req.arguments_json = rng.choice(("[]", "1", '"x"', "null", "{", "{'a': 1}", "\x00"))
    elif kind == "huge_args":
        req.arguments_json = json.dumps({"expression": "1" * rng.choice((1 << 16, 1 << 20))})
    elif kind == "nested":
        depth = rng.choice((100, 1000, 100000))
        req.arguments_json = "[" * depth + "]" * depth
    elif kind == "name":
        req.name = rng.choice(("", "python3", "calculator ", "../x", "x" * 65, random_string(rng)))
    elif kind == "python":
        code = rng.choice(
            (
                "while True: pass",
                "print('x' * 10**8)",
                "import os\nwhile True: os.fork()",
                "raise SystemExit(3)",
                "import socket; socket.create_connection(('127.0.0.1', 1))",
            )
        )
        req.name = "python"
        req.arguments_json = json.dumps({"code": code})
        req.timeout_s = 2.0
    elif kind == "timeout":
        req.timeout_s = rng.choice((math.nan, math.inf, -1.0, 1e300, 1e-9))
    elif kind == "types":
        req.arguments_json = json.dumps(
            {"expression": rng.choice((1, None, [1], {"a": 1}, True)), "extra": 1}
        )
    return Request(m, f"tools:{kind}", _body(m, [req]))


@contextlib.contextmanager
def tools_target(creds: Credentials) -> Iterator[Target]:
    from rlfleet.common.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
    from rlfleet.tools.builtin import Calculator, PythonTool
    from rlfleet.tools.core import Tool, ToolCore, ToolLimits
    from rlfleet.tools.server import start_tool_server

    tools: list[Tool] = [Calculator()]
    with contextlib.suppress(SandboxUnavailable):  # no isolation here: the calculator alone
        limits = SandboxLimits(timeout_s=2.0, cpu_time_s=2.0, memory_mb=256, max_processes=8)
        tools.append(PythonTool(Sandbox(limits)))
    core = ToolCore(tools, ToolLimits(default_timeout_s=5.0, max_timeout_s=10.0))
    with serving(creds):
        server = start_tool_server(core, port=0)
    address = server.address
    try:

        def check() -> None:
            with contextlib.closing(raw_channel(address)) as ch:
                stub = tools_pb2_grpc.ToolServiceStub(ch)
                req = tools_pb2.CallToolRequest(
                    name="calculator", arguments_json='{"expression": "6 * 7"}'
                )
                resp = stub.CallTool(req, **creds.stub_kwargs())
                assert resp.content == "42" and not resp.error, resp
                listed = stub.ListTools(tools_pb2.ListToolsRequest(), **creds.stub_kwargs())
                assert "calculator" in [t.name for t in listed.tools], listed

        yield Target(
            name="tools",
            address=address,
            tokens=creds.tokens,
            methods=methods_of(tools_pb2, "ToolService", deadline_s=20.0),
            examples={
                "ListTools": lambda rng: [tools_pb2.ListToolsRequest()],
                "CallTool": lambda rng: [_call(rng)],
            },
            generators=[*GENERIC, (gen_tool_calls, 3.0)],
            check=check,
        )
    finally:
        server.stop(0.0)
        core.close()


@contextlib.contextmanager
def serve(
    service: str, creds: Credentials, workdir: Path, model_dir: Path | None = None
) -> Iterator[Target]:
    """The fuzz target of ``service``, started with ``creds``; ``workdir`` holds the
    trainer's run dir, and the tiny model unless ``model_dir`` is given."""
    if service in ("rollout", "trainer") and model_dir is None:
        model_dir = model_dir_for(workdir / "tiny")
    if service == "reward":
        with reward_target(creds) as t:
            yield t
    elif service == "scheduler":
        with scheduler_target(creds) as t:
            yield t
    elif service == "rollout":
        assert model_dir is not None
        with rollout_target(creds, model_dir) as t:
            yield t
    elif service == "trainer":
        assert model_dir is not None
        with trainer_target(creds, model_dir, workdir / "run") as t:
            yield t
    elif service == "tools":
        with tools_target(creds) as t:
            yield t
    else:
        raise ValueError(f"unknown service {service!r}; known: {SERVICES}")
