"""Batched policy requests across environments, and policy replicas (closed_loop, policy_pool).

Batching must not change a bit of a result: each request draws its noise from its own seed, and
every forward of a model has the same rows (`pisft.policy.fixed_shape.FixedShape`), so a chunk
is the same whichever requests share its forward and whichever replica computes it. The model is
the tiny pi0.5 with its zero-initialised parameters filled (`trained_like_model_dir`): its
actions follow a forward's rows as a trained model's do, so these tests fail without the fixed
shape (`test_the_rows_of_a_forward_change_its_rounding`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from model_fixtures import trained_like_model_dir
from test_eval_closed_loop import StandInSimulator, StandInTask, settings

from pisft.policy import replicas
from pisft import rollout
from pisft import config as C
from pisft import device as device_mod
from pisft.errors import PisftError
from pisft.policy.fixed_shape import FixedShape
from pisft.policy.replicas import PolicyPool, Request
from pisft.rollout.workers import InlineWorker
from pisft.policy.libero import LiberoPolicy


class Recording:
    """A policy that keeps every chunk: its seed -> (the state it was computed from, its
    actions), and the size of every batch it was given."""

    def __init__(self, policy) -> None:
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


PROMPTS = ("put both moka pots on the stove", "open the top drawer", "pick up the book", "turn on the stove",
           "put the bowl away")
SEEDS = [11, 7, 123456789, 0, 2**40]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return LiberoPolicy.from_model_dir(trained_like_model_dir(tmp_path_factory), device="cpu")


def test_the_rows_of_a_forward_change_its_rounding(tiny_policy):
    """What the fixed shape is for (measured, pisft.policy.fixed_shape): the same request answered
    in a forward of 1, 2 or 4 rows rounds differently; with the same rows, whatever shares them,
    the bits are the same."""
    rng = np.random.default_rng(0)
    requests = [_request(rng, p) for p in PROMPTS]
    alone, pair, four = (tiny_policy.infer_batch(requests[:n], SEEDS[:n])[0]["actions"] for n in (1, 2, 4))
    assert not np.array_equal(alone, pair) and not np.array_equal(pair, four)
    others = tiny_policy.infer_batch([requests[0], *requests[2:5]], [SEEDS[0], *SEEDS[2:5]])[0]["actions"]
    np.testing.assert_array_equal(others, four)


def test_a_fixed_shape_answers_a_request_the_same_whatever_shares_its_forward(tiny_policy):
    rng = np.random.default_rng(0)
    requests = [_request(rng, p) for p in PROMPTS[:3]]
    rows = 2
    fixed = FixedShape(tiny_policy, rows)
    alone = [fixed.infer_batch([r], [s])[0]["actions"] for r, s in zip(requests, SEEDS, strict=False)]  # padded
    for n in (2, 3):  # filled, and more than one forward (the second padded)
        batched = fixed.infer_batch(requests[:n], SEEDS[:n])
        for reply, expected in zip(batched, alone, strict=False):
            np.testing.assert_array_equal(reply["actions"], expected)
    assert fixed.places_agree is True and fixed.rows_in_use == rows  # one policy thread: every place alike
    # the noise matters: the same request under another seed gives other actions
    assert not np.allclose(fixed.infer_batch(requests[:1], [12])[0]["actions"], alone[0])


def test_a_guided_fixed_shape_gives_the_actions_of_one_guided_request_at_a_time(tmp_path, tmp_path_factory):
    """Classifier-free guidance (eval.cfg_scale > 1) batches both branches: each request's
    conditioned and plain prompts stay its own."""
    import shutil

    from pisft.data import prompts

    model = tmp_path / "model"
    shutil.copytree(trained_like_model_dir(tmp_path_factory), model)
    prompts.PromptConditioning("demo").write(model / prompts.CONDITIONING_FILE)
    guided = FixedShape(LiberoPolicy.from_model_dir(model, device="cpu", cfg_scale=2.0), 2)
    assert guided.guidance["guided"]
    rng = np.random.default_rng(1)
    requests = [_request(rng, p) for p in ("open the top drawer", "pick up the book")]
    seeds = [3, 4]
    batched = guided.infer_batch(requests, seeds)
    for request, seed, reply in zip(requests, seeds, batched, strict=True):
        np.testing.assert_array_equal(reply["actions"], guided.infer_batch([request], [seed])[0]["actions"])


class Disagreeing:
    """A policy whose forward answers the last row of a batch of 5 one float32 step off, as two
    policy threads do at 5 rows here (pisft.policy.fixed_shape)."""

    def __init__(self):
        self.batches: list[int] = []

    def new_noise(self, seed=None):
        return seed

    def prepare(self, obs):
        return obs

    def predict_many(self, prepared, noises):
        self.batches.append(len(prepared))
        out = [{"actions": np.full((2, 7), float(x), np.float32)} for x in prepared]
        if len(prepared) == 5:
            out[-1]["actions"] = np.nextafter(out[-1]["actions"], np.float32(np.inf))
        return out


def test_rows_whose_places_disagree_fall_back_to_one_row_per_forward(capsys):
    policy = Disagreeing()
    fixed = FixedShape(policy, 5, name="closed_loop")
    replies = fixed.predict_many([1.0, 2.0, 3.0], [1, 2, 3])
    assert [float(r["actions"][0, 0]) for r in replies] == [1.0, 2.0, 3.0]
    assert fixed.places_agree is False and fixed.rows_in_use == 1
    assert policy.batches == [5, 1, 1, 1]  # the check (5 copies of the first request), then one row each
    assert "closed_loop: note: a forward of 5 rows rounds a request differently by its place" in capsys.readouterr().out
    assert fixed.record() == {"rows": 5, "rows_in_use": 1, "places_agree": False}


TASKS = [StandInTask("reach 0.3 0 0", [0.3, 0, 0]), StandInTask("reach 0.2 0 0", [0.2, 0, 0])]


def _roll_out(policy, *, num_envs, policy_batch):
    """`policy`: one, or a list of replicas; `policy_batch`: the pool's limit of requests per batch."""
    sim = StandInSimulator(TASKS, placement_noise=0.02)
    s = settings(trials_per_task=3, max_steps=20, policy_batch=max(policy_batch, 1))
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


def test_episodes_do_not_depend_on_the_batches_nor_the_number_of_environments(tiny_policy):
    runs = {}
    for num_envs, batch in ((1, 1), (3, 1), (3, 0), (3, 2)):
        recording = Recording(FixedShape(tiny_policy, 3))
        outcomes, stats = _roll_out(recording, num_envs=num_envs, policy_batch=batch)
        runs[(num_envs, batch)] = (outcomes, recording.chunks)
        # the environments waiting at one moment share a forward, up to the pool's limit
        assert max(recording.batches) == {(1, 1): 1, (3, 1): 1, (3, 0): 3, (3, 2): 2}[(num_envs, batch)]
        assert stats.requests == len(recording.chunks) == sum(o[-1] for o in outcomes)
    reference_outcomes, reference = runs[(1, 1)]
    for key, (outcomes, chunks) in runs.items():
        assert outcomes == reference_outcomes, key
        assert chunks.keys() == reference.keys(), key
        for seed, (state, actions) in chunks.items():
            np.testing.assert_array_equal(state, reference[seed][0])
            np.testing.assert_array_equal(actions, reference[seed][1])
    # the check is not vacuous: the placement noise and the policy's noise make chunks differ
    assert len({a.tobytes() for _, a in reference.values()}) == len(reference)


def test_replicas_share_the_requests_and_give_the_same_episodes(tmp_path_factory, tiny_policy):
    second = LiberoPolicy.from_model_dir(trained_like_model_dir(tmp_path_factory), device="cpu")
    one = Recording(FixedShape(tiny_policy, 2))
    single, _ = _roll_out(one, num_envs=3, policy_batch=2)
    replicas = [Recording(FixedShape(tiny_policy, 2)), Recording(FixedShape(second, 2))]
    double, stats = _roll_out(replicas, num_envs=3, policy_batch=2)
    assert double == single
    # at the first dispatch three requests wait: two go to replica 0, the third to replica 1
    assert all(n > 0 for n in stats.per_replica_requests) and sum(stats.per_replica_requests) == stats.requests
    merged = {**replicas[0].chunks, **replicas[1].chunks}
    assert merged.keys() == one.chunks.keys()
    for seed, (_, actions) in merged.items():
        np.testing.assert_array_equal(actions, one.chunks[seed][1])


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


def test_a_negative_device_count_is_refused():
    with pytest.raises(PisftError, match=r"eval.policy_devices: must be 0"):
        C.from_dict({"eval": {"policy_devices": -1}})


@pytest.mark.parametrize("rows", [0, -1])
def test_a_forward_of_no_rows_is_refused_with_what_to_set(rows):
    with pytest.raises(PisftError, match=r"eval.policy_batch: the rows of every policy forward must be at least 1 "
                                         rf"\(0, every environment waiting, is gone.*got {rows}"):
        C.from_dict({"eval": {"policy_batch": rows}})
