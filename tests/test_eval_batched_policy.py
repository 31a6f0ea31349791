"""Batched policy requests across environments, and policy replicas (closed_loop, policy_pool).

Batching must not change a result: each request draws its noise from its own seed, so a chunk
is the same whichever requests share its forward and whichever replica computes it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from model_fixtures import tiny_model_dir
from test_eval_closed_loop import StandInSimulator, StandInTask, settings

from pisft.policy import replicas
from pisft import rollout
from pisft import config as C
from pisft import device as device_mod
from pisft.errors import PisftError
from pisft.policy.replicas import PolicyPool, Request
from pisft.rollout.workers import InlineWorker
from pisft.policy.libero import LiberoPolicy

# On this CPU a batched forward gives the bits of one request at a time (measured; also
# `python -m pisft bench --only closed_loop`'s actions_match). The tests allow fp32 rounding, as an
# accelerator's kernels may round differently with the batch size.
ATOL = 1e-6


class Recording:
    """A LiberoPolicy that keeps every chunk: its seed -> (the state it was computed from, its
    actions), and the size of every forward."""

    def __init__(self, policy: LiberoPolicy) -> None:
        self.policy = policy
        self.chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.batches: list[int] = []

    def infer_batch(self, requests, seeds):
        replies = self.policy.infer_batch(requests, seeds)
        self.batches.append(len(requests))
        for request, seed, reply in zip(requests, seeds, replies, strict=True):
            self.chunks[seed] = (np.array(request["observation/state"]), reply["actions"])
        return replies


def _request(rng, prompt):
    return {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.normal(size=8).astype(np.float32), "prompt": prompt}


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return LiberoPolicy.from_model_dir(tiny_model_dir(tmp_path_factory), device="cpu")


def test_one_forward_gives_the_actions_of_one_request_at_a_time(tiny_policy):
    rng = np.random.default_rng(0)
    requests = [_request(rng, p) for p in ("put both moka pots on the stove", "open the top drawer",
                                            "pick up the book", "turn on the stove", "put the bowl away")]
    seeds = [11, 7, 123456789, 0, 2**40]
    batched = tiny_policy.infer_batch(requests, seeds)
    for request, seed, reply in zip(requests, seeds, batched, strict=True):
        tiny_policy.reset(seed)
        alone = tiny_policy.infer(request)["actions"]
        np.testing.assert_allclose(reply["actions"], alone, rtol=0, atol=ATOL)
    # the noise matters: the same request under another seed gives other actions
    assert not np.allclose(tiny_policy.infer_batch(requests[:1], [12])[0]["actions"], batched[0]["actions"])


def test_a_guided_batch_gives_the_actions_of_one_guided_request_at_a_time(tmp_path, tmp_path_factory):
    """Classifier-free guidance (eval.cfg_scale > 1) batches both branches: each request's
    conditioned and plain prompts stay its own."""
    from pisft.data import prompts

    model = tiny_model_dir(tmp_path_factory, tmp_path / "model")
    prompts.PromptConditioning("demo").write(model / prompts.CONDITIONING_FILE)
    guided = LiberoPolicy.from_model_dir(model, device="cpu", cfg_scale=2.0)
    assert guided.guidance["guided"]
    rng = np.random.default_rng(1)
    requests = [_request(rng, p) for p in ("open the top drawer", "pick up the book", "turn on the stove")]
    seeds = [3, 4, 5]
    batched = guided.infer_batch(requests, seeds)
    for request, seed, reply in zip(requests, seeds, batched, strict=True):
        guided.reset(seed)
        np.testing.assert_allclose(reply["actions"], guided.infer(request)["actions"], rtol=0, atol=ATOL)


TASKS = [StandInTask("reach 0.3 0 0", [0.3, 0, 0]), StandInTask("reach 0.2 0 0", [0.2, 0, 0])]


def _roll_out(policy, *, num_envs, policy_batch):
    """`policy`: one, or a list of replicas."""
    sim = StandInSimulator(TASKS, placement_noise=0.02)
    s = settings(trials_per_task=3, max_steps=20, policy_batch=policy_batch)
    specs, languages = rollout.plan_episodes(sim, s, None)
    workers = [InlineWorker(sim) for _ in range(num_envs)]
    pool = PolicyPool(policy if isinstance(policy, list) else [policy], max_batch=policy_batch)
    try:
        results = rollout.run_episodes(specs, pool, s, workers=workers, languages=languages)
    finally:
        pool.close()
        for w in workers:
            w.close()
    return [(r.task_id, r.trial, r.success, r.steps, r.policy_calls) for r in results], pool.stats


def test_episodes_do_not_depend_on_the_batch_size_nor_the_number_of_environments(tiny_policy):
    runs = {}
    for num_envs, batch in ((1, 1), (3, 1), (3, 0), (3, 2)):
        recording = Recording(tiny_policy)
        outcomes, stats = _roll_out(recording, num_envs=num_envs, policy_batch=batch)
        runs[(num_envs, batch)] = (outcomes, recording.chunks)
        # the environments waiting at one moment share a forward, up to eval.policy_batch
        assert max(recording.batches) == {(1, 1): 1, (3, 1): 1, (3, 0): 3, (3, 2): 2}[(num_envs, batch)]
        assert stats.requests == len(recording.chunks) == sum(o[-1] for o in outcomes)
    reference_outcomes, reference = runs[(1, 1)]
    for key, (outcomes, chunks) in runs.items():
        assert outcomes == reference_outcomes, key
        assert chunks.keys() == reference.keys(), key
        for seed, (state, actions) in chunks.items():
            np.testing.assert_allclose(state, reference[seed][0], rtol=0, atol=ATOL)
            np.testing.assert_allclose(actions, reference[seed][1], rtol=0, atol=ATOL)
    # the check is not vacuous: the placement noise and the policy's noise make chunks differ
    assert len({a.tobytes() for _, a in reference.values()}) == len(reference)


def test_replicas_share_the_requests_and_give_the_same_episodes(tmp_path_factory, tiny_policy):
    second = LiberoPolicy.from_model_dir(tiny_model_dir(tmp_path_factory), device="cpu")
    one = Recording(tiny_policy)
    single, _ = _roll_out(one, num_envs=3, policy_batch=2)
    replicas = [Recording(tiny_policy), Recording(second)]
    double, stats = _roll_out(replicas, num_envs=3, policy_batch=2)
    assert double == single
    # at the first dispatch three requests wait: two go to replica 0, the third to replica 1
    assert all(n > 0 for n in stats.per_replica_requests) and sum(stats.per_replica_requests) == stats.requests
    merged = {**replicas[0].chunks, **replicas[1].chunks}
    assert merged.keys() == one.chunks.keys()
    for seed, (_, actions) in merged.items():
        np.testing.assert_allclose(actions, one.chunks[seed][1], rtol=0, atol=ATOL)


class Flaky:
    """infer_batch fails for any batch holding a request marked bad, as a model would on a
    request it cannot take; alone, the others are answered."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def infer_batch(self, requests, seeds):
        self.calls.append(list(seeds))
        if any(r.get("bad") for r in requests):
            raise ValueError("a request the model cannot take")
        return [{"actions": np.full((5, 7), float(s))} for s in seeds]


def _answers(pool, requests):
    pool.submit(requests)
    out = []
    while len(out) < len(requests):
        assert pool.notify.poll(60), "no answer within 60 s"
        out += pool.collect()
    return {a.key: a for a in out}


def test_a_bad_request_errs_alone_and_its_batch_mates_are_answered():
    policy = Flaky()
    pool = PolicyPool([policy])
    try:
        answers = _answers(pool, [Request(0, {}, 10), Request(1, {"bad": True}, 11), Request(2, {}, 12)])
    finally:
        pool.close()
    assert answers[1].actions is None and answers[1].error == "ValueError: a request the model cannot take"
    for key, seed in ((0, 10), (2, 12)):
        assert answers[key].error is None and (answers[key].actions == seed).all()
    # the batch first, then each request alone
    assert policy.calls == [[10, 11, 12], [10], [11], [12]]
    assert pool.stats.forwards == 1 and pool.stats.requests == 3


def test_each_replica_selects_its_device_in_its_own_thread():
    seen: dict[int, str] = {}
    lock = threading.Lock()

    def select(i):
        with lock:
            seen[i] = threading.current_thread().name

    pool = PolicyPool([Flaky(), Flaky()], devices=["cuda:0", "cuda:1"], select_device=select)
    try:
        first = _answers(pool, [Request(0, {}, 1)])
        assert first[0].error is None
    finally:
        pool.close()
    assert seen == {0: "policy-replica0", 1: "policy-replica1"}


def test_a_replica_that_cannot_select_its_device_stops_the_run_with_the_reason():
    def select(i):
        raise RuntimeError(f"device {i} is in use")

    pool = PolicyPool([Flaky()], select_device=select)
    try:
        assert pool.notify.poll(60)
        with pytest.raises(RuntimeError, match="could not select its device: RuntimeError: device 0 is in use"):
            pool.collect()
    finally:
        pool.close()


def test_one_replica_per_visible_accelerator_and_one_on_the_cpu(monkeypatch):
    cfg = C.from_dict({"device": "cuda"})
    monkeypatch.setattr(device_mod, "resolve_kind", lambda requested: "cuda")
    monkeypatch.setattr(device_mod, "device_count", lambda kind: 8)
    assert replicas.policy_devices(cfg) == [f"cuda:{i}" for i in range(8)]
    cfg.eval.policy_devices = 2
    assert replicas.policy_devices(cfg) == ["cuda:0", "cuda:1"]
    cfg.eval.policy_devices = 9
    with pytest.raises(PisftError, match="9 policy replicas asked for, but 8 cuda device"):
        replicas.policy_devices(cfg)
    monkeypatch.setattr(device_mod, "resolve_kind", lambda requested: "cpu")
    cfg.eval.policy_devices = 0
    assert replicas.policy_devices(cfg) == ["cpu"]
    cfg.eval.policy_devices = 2
    with pytest.raises(PisftError, match="runs on the CPU, where it is one"):
        replicas.policy_devices(cfg)


@pytest.mark.parametrize("key", ["policy_batch", "policy_devices"])
def test_a_negative_batch_or_device_count_is_refused(key):
    with pytest.raises(PisftError, match=rf"eval.{key}: must be 0"):
        C.from_dict({"eval": {key: -1}})
