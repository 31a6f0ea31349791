"""eval.seeds and eval.perturbations in the closed_loop stage and recap_summary, against the stand-in
simulator of tests/test_eval_closed_loop.py (inline, seconds). What each perturbation does to a real
LIBERO scene is tests/test_perturb_libero.py's."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from test_eval_closed_loop import GoalSeekingPolicy, StandInSimulator, StandInTask, make_cfg

from pisft import config as C
from pisft import layout, rollout
from pisft.errors import PisftError
from pisft.evaluate import closed_loop, robustness
from pisft.recap import summary
from pisft.rollout import perturb
from pisft.rollout.scheduler import EpisodeResult
from pisft.rollout.workers import EpisodeSpec

TASKS = [StandInTask("reach 0.3 0 0", [0.3, 0, 0]), StandInTask("reach 0.45 0 0", [0.45, 0, 0])]


@pytest.mark.parametrize(("entry", "message"), [
    ("camra", r"eval.perturbations\[0\]: unknown perturbation 'camra'; did you mean 'camera'\?"),
    ({"name": "camera", "strength": 90}, r"camera's strength 90 is not a number in \[0, 45\] \(degrees\)"),
    ({"name": "lighting", "strength": -1}, r"lighting's strength -1 is not a number in \[-0.9, 4\]"),
    ({"name": "language", "strength": 0.5}, "must be 0 .* or 1 .*one cited paraphrase per task"),
    ({"name": "obs_noise", "strenght": 0.1}, r"unknown key\(s\) \['strenght'\]"),
    ({"name": "obs_noise", "strength": True}, "obs_noise's strength True is not a number"),
])
def test_a_wrong_perturbation_is_named_with_what_to_write(entry, message):
    with pytest.raises(C.ConfigError, match=message):
        C.from_dict({"eval": {"perturbations": [entry]}})


def test_perturbations_and_seeds_as_written_and_what_is_refused():
    e = C.from_dict({"eval": {"seeds": [7, 8, 9], "perturbations": [
        "camera", {"name": "lighting", "strength": -0.5}, {"name": "lighting"},
        {"name": "obs_noise", "strength": None}]}}).eval  # `strength:` left empty in YAML: the default
    assert C.perturbation_conditions(e) == [("camera", 10.0), ("lighting", -0.5), ("lighting", 0.5),
                                            ("obs_noise", 0.05)]
    assert C.closed_loop_seeds(e) == [7, 8, 9]
    assert C.closed_loop_seeds(C.from_dict({"eval": {"closed_loop_seed": 3}}).eval) == [3]
    with pytest.raises(C.ConfigError, match="listed twice"):
        C.from_dict({"eval": {"perturbations": ["camera", {"name": "camera", "strength": 10}]}})
    with pytest.raises(C.ConfigError, match="listed twice .*share the key 'robot_init_0.1'"):
        C.from_dict({"eval": {"perturbations": [{"name": "robot_init", "strength": 0.1},
                                                {"name": "robot_init", "strength": 0.1000001}]}})
    with pytest.raises(C.ConfigError, match=r"eval.seeds: \[8, 9\] starts with 8 but eval.closed_loop_seed is 7: .*"
                                            r"start eval.seeds with 7 or set eval.closed_loop_seed: 8"):
        C.from_dict({"eval": {"seeds": [8, 9]}})
    with pytest.raises(C.ConfigError, match="distinct seeds >= 0"):
        C.from_dict({"eval": {"seeds": [7, 7]}})


def test_a_draw_is_the_episodes_and_strength_0_draws_nothing():
    """Pure in (seed, episode): the same episode draws the same, another seed or initial state draws
    otherwise; strength only scales it (the generator does not see it); 0 is no perturbation at all."""
    def draw(p, seed=7, init_state=0):
        return perturb.for_episode(p, seed=seed, suite="libero_10", task_id=1, init_state=init_state)._rng().random(3)

    cam = perturb.Perturbation("camera", 10)
    np.testing.assert_array_equal(draw(cam), draw(cam))
    np.testing.assert_array_equal(draw(cam), draw(perturb.Perturbation("camera", 20)))
    assert not np.array_equal(draw(cam), draw(cam, seed=8))
    assert not np.array_equal(draw(cam), draw(cam, init_state=1))
    assert not np.array_equal(draw(cam), draw(perturb.Perturbation("robot_init", 0.1)))
    for name in C.PERTURBATIONS:
        assert perturb.for_episode(perturb.Perturbation(name, 0), seed=7, suite="libero_10", task_id=0,
                                   init_state=0) is None


def _run(tmp_path, name, **eval_keys):
    cfg = make_cfg(tmp_path / name, libero_suites=["libero_10"], trials_per_task=2, max_steps=30, **eval_keys)
    policy = GoalSeekingPolicy(noise=0.3)  # some episodes succeed, how many depends on the seed
    metrics = closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, TASKS, placement_noise=0.02),
                              policy=policy, inline=True)
    out = tmp_path / name / "results" / "closed_loop"
    return metrics, out, policy


def test_strength_0_and_no_perturbation_are_openpis_protocol_byte_for_byte(tmp_path):
    """The evaluation's own outputs are the bytes of a run without eval.perturbations; the same episodes
    at strength 0 are those bytes again (video included); at strength 0.3 the policy saw other pixels."""
    plain, plain_out, _ = _run(tmp_path, "plain")
    noisy, out, policy = _run(tmp_path, "noisy", perturbations=[{"name": "obs_noise", "strength": 0.3},
                                                                {"name": "obs_noise", "strength": 0}])
    def same(metrics):  # what does not name the run's own folder
        return {k: v for k, v in metrics.items() if k not in ("robustness", "model_dir")}

    assert same(noisy) == same(plain) and "robustness" not in plain
    lines = (out / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 12 and "\n".join(lines[:4]) + "\n" == (plain_out / "episodes.jsonl").read_text()
    at_zero = [json.loads(line) for line in lines[8:]]
    def episode(e):  # one video per perturbation: its first episode's
        return {k: v for k, v in e.items() if k not in ("video", "video_frames", "perturbation")}

    assert [episode(e) for e in at_zero] == [episode(json.loads(line)) for line in lines[:4]]
    assert all(e["perturbation"] == {"name": "obs_noise", "strength": 0} for e in at_zero)  # what it ran under
    assert at_zero[0]["video"] == "videos/obs_noise_0/libero_10_task00.mp4"
    assert (out / at_zero[0]["video"]).read_bytes() == (plain_out / "videos/libero_10_task00.mp4").read_bytes()
    noised = [json.loads(line) for line in lines[4:8]]
    assert all(e["perturbation"] == {"name": "obs_noise", "strength": 0.3, "std": 0.3 * 255} for e in noised)
    assert (out / noised[0]["video"]).read_bytes() != (plain_out / "videos/libero_10_task00.mp4").read_bytes()
    assert (out / "videos/obs_noise_0.3/libero_10_task00.html").is_file()
    # the same chunks (seeds) were asked for with the same state and other pixels
    wrist = [r["observation/wrist_image"] for r in policy.requests]
    seed0 = rollout.chunk_seed(rollout.episode_seed(7, "libero_10", 0, 0), 0)
    asked = [i for i, s in enumerate(policy.seeds) if s == seed0]  # unperturbed, 0.3, 0: the plan's order
    assert len(asked) == 3
    assert np.array_equal(wrist[asked[0]], wrist[asked[2]]) and not np.array_equal(wrist[asked[0]], wrist[asked[1]])
    rob = noisy["robustness"]
    assert rob["seeds"] == [7] and rob["unperturbed"]["trials"] == 4
    entry = rob["perturbations"]["obs_noise_0.3"]
    assert entry["trials"] == 4 and entry["unperturbed_success_rate"] == plain["success_rate"]
    assert entry["video"] == "videos/obs_noise_0.3/libero_10_task00.mp4"
    assert entry["drop"] == plain["success_rate"] - entry["success_rate"]
    assert "## Robustness" in (out / "report.md").read_text()
    assert "## Robustness" not in (plain_out / "report.md").read_text()


def test_several_seeds_pool_the_trials_and_give_each_seed(tmp_path):
    metrics, out, policy = _run(tmp_path, "seeds", seeds=[7, 8])
    assert (metrics["trials"], metrics["episodes"]) == (8, 8)
    assert set(metrics["seeds"]) == {"7", "8"} and all(e["trials"] == 4 for e in metrics["seeds"].values())
    assert metrics["successes"] == sum(e["successes"] for e in metrics["seeds"].values())
    rates = [e["success_rate"] for e in metrics["seeds"].values()]
    assert max(rates) > min(rates)  # the seeds matter here, so the spread is not 0 by construction
    assert metrics["seed_spread"]["range"] == max(rates) - min(rates)
    assert metrics["seed_spread"]["std"] == pytest.approx(float(np.std(rates, ddof=1)))
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["seed"] for e in episodes] == [7] * 4 + [8] * 4
    assert [e["video"] is not None for e in episodes] == [True, False, True, False] + [False] * 4
    # seed 8's episodes drew their noise from seed 8: every chunk seed of its episodes was asked for
    for task in (0, 1):
        for trial in (0, 1):
            assert rollout.chunk_seed(rollout.episode_seed(8, "libero_10", task, trial), 0) in policy.seeds
    report = (out / "report.md").read_text()
    assert "## Seeds" in report and "pools the unperturbed episodes of 2 seeds (7, 8" in report
    from pisft.evaluate.report import closed_loop_section  # results/eval/report.md repeats it

    assert "pools the unperturbed episodes of 2 seeds (7, 8" in "\n".join(closed_loop_section(metrics))


def test_what_a_simulator_cannot_perturb_is_refused_before_any_rollout(tmp_path):
    with pytest.raises(PisftError, match="camera edits LIBERO's MuJoCo scene, and this simulator .* is not LIBERO's"):
        _run(tmp_path, "cam", perturbations=["camera"])
    with pytest.raises(PisftError, match=r"LIBERO-Pro has no paraphrase of libero_10 task 0, libero_10 task 1 "):
        _run(tmp_path, "lang", perturbations=["language"])
    assert not (tmp_path / "cam/results/closed_loop").exists()


def _metrics_with_robustness(path, base, perturbed):
    """closed_loop/metrics.json as the stage writes it for `base` (task -> outcomes of its trials) and
    each perturbation's outcomes on the same episodes."""
    specs, conditions, results = [], [], []
    perturbations = [perturb.Perturbation(*key) for key in perturbed]
    for p, outcomes in [(None, base), *zip(perturbations, perturbed.values(), strict=True)]:
        for task, oks in outcomes.items():
            for trial, ok in enumerate(oks):
                specs.append(EpisodeSpec(len(specs), "libero_10", task, trial, 10, 0, 7, 224, perturbation=p))
                conditions.append(robustness.Condition(7, p))
                results.append(EpisodeResult("libero_10", task, f"task {task}", trial, ok, 10, 2, 0.1))
    plan = robustness.Plan(specs, conditions, [7], perturbations)
    metrics = {"closed_loop": True, **closed_loop.summarize(plan.unperturbed(results)),
               **robustness.summary(plan, results)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics))


def test_recap_summary_gives_success_under_each_perturbation_per_iteration(tmp_path):
    from test_recap_summary import _iteration_outputs

    cfg = C.from_dict({"results_dir": str(tmp_path / "results"), "recap": {"iterations": 1},
                       "eval": {"closed_loop": True, "task_ids": [0, 1], "trials_per_task": 2,
                                "perturbations": ["camera"]}})
    _metrics_with_robustness(layout.results(cfg, "closed_loop", "metrics.json"),
                             {0: [True, True], 1: [True, False]},
                             {("camera", 10.0): {0: [True, False], 1: [False, False]}})
    _iteration_outputs(cfg, 1)
    _metrics_with_robustness(layout.results(cfg.at_iteration(1), "closed_loop", "metrics.json"),
                             {0: [True, True], 1: [True, True]},
                             {("camera", 10.0): {0: [True, True], 1: [True, False]}})
    summary.run(cfg)
    its = json.loads(layout.results(cfg, "recap", "metrics.json").read_text())["iterations"]
    assert [it["closed_loop"]["robustness"]["camera_10"]["success_rate"] for it in its] == [0.25, 0.75]
    assert [it["closed_loop"]["robustness"]["camera_10"]["relative_drop"] for it in its] == [pytest.approx(2 / 3), 0.25]
    report = layout.results(cfg, "recap", "report.md").read_text()
    assert "## Robustness per iteration" in report
    assert "| unperturbed | 75.0% | 100.0% |" in report and "| camera 10° | 25.0% (66.7%) | 75.0% (25.0%) |" in report
