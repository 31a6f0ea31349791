"""Each perturbation does what it says, seen in the real LIBERO simulator (hf-libero, robosuite, MuJoCo):
the first rendered frame of LIBERO-10 task 0 at initial state 0 and seed 7 (no wait steps, so the frame is
the initial state as the perturbation left it), against the unperturbed frame of the same episode.

- camera: the same scene (every joint, the wrist image, the state) from another pose of the agent view,
  which orbited its look-at point by the strength, at the same distance, still looking at it;
- lighting: mean brightness up at +0.5, down at -0.5, the scene untouched, the lights scaled;
- robot_init: the arm's joint vector differs by the strength (its norm), nothing else;
- object_position: every object moved by the strength in the table plane, nothing else;
- language: the prompt is LIBERO-Pro's paraphrase, every pixel and number the same;
- obs_noise: the same scene, pixels off by noise of the strength's standard deviation;
- and the unperturbed episode run after all of them is the same bytes as before (nothing carries over).

At strength 0 the frame is the unperturbed one, bytes and all (and every name at 0 draws nothing, the
stage writes the same bytes: `tests/test_robustness.py`). Rendering is on the CPU here: ten resets of
3-5 s each.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from pisft.rollout import libero_sim, perturb
from pisft.rollout.paraphrases import PARAPHRASES
from pisft.rollout.workers import EpisodeRunner, EpisodeSpec

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("libero") is None,
                       reason="the LIBERO simulator (hf-libero) is not installed in this environment; "
                              "`make setup` installs it (docs/libero.md, 'The LIBERO simulator')"),
]

SUITE, TASK = "libero_10", 0


@pytest.fixture(scope="module")
def first_frame():
    """The first frame of the episode under a perturbation: (request, qpos, raw images, record, model)."""
    runner = EpisodeRunner(libero_sim.LiberoSimulator())

    def render(p: perturb.Perturbation | None) -> dict:
        request = runner.start(EpisodeSpec(index=0, suite=SUITE, task_id=TASK, trial=0, max_steps=10,
                                           num_wait_steps=0, env_seed=7, resize_size=224, perturbation=p))
        ep = runner._episode
        m = ep.env.sim.model._model
        cam = m.cam(perturb.CAMERA).id
        out = {"request": request, "qpos": ep.env.sim.data.qpos.copy(), "record": ep.outcome.perturbation,
               "images": {k: np.array(ep.obs[k], copy=True) for k in perturb.IMAGES},
               "cam_pos": m.cam_pos[cam].copy(), "cam_quat": m.cam_quat[cam].copy(),
               "light_diffuse": m.light_diffuse.copy(), "env": ep.env}
        runner.finish()
        return out

    yield render
    runner.close()


@pytest.fixture(scope="module")
def base(first_frame):
    return first_frame(None)


def _same_scene(a, b):
    np.testing.assert_array_equal(a["qpos"], b["qpos"])
    np.testing.assert_array_equal(a["request"]["observation/state"], b["request"]["observation/state"])


def test_camera_shows_the_same_scene_from_another_pose(first_frame, base):
    got = first_frame(perturb.Perturbation("camera", 10))
    _same_scene(got, base)
    wrist = "robot0_eye_in_hand_image"
    np.testing.assert_array_equal(got["images"][wrist], base["images"][wrist])
    assert np.abs(got["images"]["agentview_image"].astype(float) - base["images"]["agentview_image"]).mean() > 5
    look = np.array(got["record"]["look_at"])
    old, new = base["cam_pos"] - look, got["cam_pos"] - look
    assert np.linalg.norm(new) == pytest.approx(np.linalg.norm(old), rel=1e-9)
    angle = math.degrees(math.acos(np.dot(old, new) / np.linalg.norm(old) / np.linalg.norm(new)))
    assert angle == pytest.approx(10, abs=1e-6)
    frame = np.zeros(9)
    import mujoco

    mujoco.mju_quat2Mat(frame, got["cam_quat"])
    view = -frame.reshape(3, 3)[:, 2]  # a MuJoCo camera looks along its -z axis
    assert np.dot(view, -new / np.linalg.norm(new)) == pytest.approx(1.0, abs=1e-9)  # still at the look-at point


@pytest.mark.parametrize("strength", [0.5, -0.5])
def test_lighting_moves_the_mean_brightness(first_frame, base, strength):
    got = first_frame(perturb.Perturbation("lighting", strength))
    _same_scene(got, base)
    np.testing.assert_allclose(got["light_diffuse"], base["light_diffuse"] * (1 + strength))
    for key in perturb.IMAGES:
        moved = got["images"][key].mean() - base["images"][key].mean()
        assert np.sign(moved) == np.sign(strength) and abs(moved) > 5, (key, moved)


def test_robot_init_moves_the_joint_vector_by_the_strength(first_frame, base):
    got = first_frame(perturb.Perturbation("robot_init", 0.2))
    arm = slice(0, 7)  # the Panda's joints come first in LIBERO's qpos (robot0_joint1..7)
    assert got["env"].robots[0]._ref_joint_pos_indexes == list(range(7))
    assert np.linalg.norm(got["qpos"][arm] - base["qpos"][arm]) == pytest.approx(0.2, abs=1e-9)
    np.testing.assert_allclose(got["qpos"][arm] - base["qpos"][arm], got["record"]["joint_offset_rad"], atol=1e-12)
    np.testing.assert_array_equal(got["qpos"][7:], base["qpos"][7:])
    assert not np.array_equal(got["request"]["observation/state"], base["request"]["observation/state"])


def test_object_position_moves_each_object_by_the_strength(first_frame, base):
    got = first_frame(perturb.Perturbation("object_position", 0.04))
    moved = got["record"]["moved_xy_m"]
    assert len(moved) >= 6 and got["record"]["stayed"] == []  # LIBERO-10 task 0 has 8 movable objects
    m = got["env"].sim.model._model
    touched = np.zeros(len(base["qpos"]), bool)
    for name, shift in moved.items():
        adr = m.jnt_qposadr[m.joint(f"{name}_joint0").id]
        assert np.linalg.norm(got["qpos"][adr:adr + 2] - base["qpos"][adr:adr + 2]) == pytest.approx(0.04, abs=1e-9)
        np.testing.assert_allclose(got["qpos"][adr:adr + 2] - base["qpos"][adr:adr + 2], shift, atol=1e-12)
        touched[adr:adr + 2] = True
    np.testing.assert_array_equal(got["qpos"][~touched], base["qpos"][~touched])  # heights, turns, the arm


def test_language_is_libero_pros_paraphrase_and_nothing_else(first_frame, base):
    got = first_frame(perturb.Perturbation("language", 1))
    task = libero_sim.LiberoSimulator().suite(SUITE).get_task(TASK)
    assert got["request"]["prompt"] == PARAPHRASES[(SUITE, task.name)] != task.language
    _same_scene(got, base)
    for key in ("observation/image", "observation/wrist_image"):
        np.testing.assert_array_equal(got["request"][key], base["request"][key])


def test_obs_noise_adds_noise_of_the_strength(first_frame, base):
    got = first_frame(perturb.Perturbation("obs_noise", 0.1))
    _same_scene(got, base)
    for key in perturb.IMAGES:
        before = base["images"][key].astype(np.float64)
        unclipped = (before > 90) & (before < 165)  # 3 standard deviations from either end
        diff = (got["images"][key].astype(np.float64) - before)[unclipped]
        assert diff.std() == pytest.approx(0.1 * 255, rel=0.05) and abs(diff.mean()) < 1


def test_strength_0_renders_todays_frame(first_frame, base):
    """Through the worker's whole path (every name at 0 draws nothing: tests/test_robustness.py)."""
    got = first_frame(perturb.Perturbation("camera", 0))
    assert got["record"] is None
    _same_scene(got, base)
    for key in ("observation/image", "observation/wrist_image", "prompt"):
        np.testing.assert_array_equal(got["request"][key], base["request"][key])
    for key in perturb.IMAGES:
        np.testing.assert_array_equal(got["images"][key], base["images"][key])


def test_nothing_carries_over_to_the_next_episode(first_frame, base):
    first_frame(perturb.Perturbation("lighting", 1.0))
    again = first_frame(None)
    _same_scene(again, base)
    for key in perturb.IMAGES:
        np.testing.assert_array_equal(again["images"][key], base["images"][key])


def test_the_paraphrases_cover_the_four_suites_task_by_task():
    sim = libero_sim.LiberoSimulator()
    names = {(s, sim.suite(s).get_task(i).name) for s in ("libero_spatial", "libero_object", "libero_goal",
                                                         "libero_10") for i in range(10)}
    assert set(PARAPHRASES) == names
