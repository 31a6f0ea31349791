"""Perturbed closed-loop episodes (`eval.perturbations`, docs/robustness.md): what each perturbation
does to an episode, as a pure function of (run seed, episode, strength).

An episode (`pisft.rollout.workers.EpisodeSpec`) may carry one `Perturbation` (a name of
`pisft.config.PERTURBATIONS` and a strength). The worker asks `for_episode` for the episode's
draw, from a generator seeded by the run seed, the suite, the task, the initial state number and
the perturbation's name (not its strength: the same episode moves the same way at every strength,
only by more), then applies it once the environment is at its initial state (`start`) and to every
observation after (`observe`). Strength 0 draws nothing and touches nothing: the episode is
openpi's, byte for byte (`Perturbation.active`).

- `camera`: the agent-view camera orbits the point of its optical axis nearest the movable objects'
  centre by `strength` degrees, in a direction drawn per episode (`direction_deg`: 0 turns it about
  its own up axis, 90 about its right axis); it still looks at that point, at the same distance. The
  wrist camera and the scene are untouched.
- `lighting`: every light's diffuse, ambient and specular colour, and the headlight's, times
  (1 + strength): brighter above 0, darker below.
- `robot_init`: the arm's 7 joint angles moved by a vector of norm `strength` radians in a
  direction drawn per episode, within the joints' limits and without pressing into anything that
  was not touching the arm before (else drawn again).
- `object_position`: every free-moving object slid `strength` metres in the table plane, in a
  direction drawn per object, without pressing into anything it did not touch before (else drawn
  again; after 50 draws the object stays and the episode's record says so).
- `language`: the prompt is LIBERO-Pro's paraphrase of the task (`pisft.rollout.paraphrases`).
- `obs_noise`: Gaussian noise of standard deviation strength × 255 on every pixel of both cameras'
  images after every step (the video shows what the policy saw), drawn per step.

The scene changes (camera, lighting, joints, objects) edit LIBERO's MuJoCo model and state after
`set_init_state` and re-derive the observation the way LIBERO does after setting a state
(`ControlEnv.regenerate_obs_from_state`, hf-libero 0.1.4 `libero/libero/envs/env_wrapper.py`).
LIBERO rebuilds its model at every reset (robosuite 1.4.0 `MujocoEnv.reset` with `hard_reset=True`),
so nothing carries over to the worker's next episode. A simulator without LIBERO's MuJoCo scene (a
stand-in) can still take `language` and `obs_noise`; a scene perturbation on it is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pisft.config import PERTURBATIONS, perturbation_key
from pisft.errors import PisftError
from pisft.rollout import libero_sim
from pisft.rollout.paraphrases import PARAPHRASES

CAMERA = "agentview"  # the camera LIBERO's agent view renders from (openpi's "observation/image")
IMAGES = ("agentview_image", "robot0_eye_in_hand_image")
SCENE = ("camera", "lighting", "robot_init", "object_position")  # those that edit LIBERO's MuJoCo scene
# A draw of robot_init or object_position is refused when it presses two bodies that were not in
# contact into each other deeper than this (metres): LIBERO's own settled contacts stay as they are.
PENETRATION_M = 1e-3
DRAWS = 50  # draws before an object stays where it is (robot_init: an error)


@dataclass(frozen=True)
class Perturbation:
    """One condition of `eval.perturbations`: a perturbation's name and its strength."""

    name: str
    strength: float

    def __post_init__(self) -> None:
        if self.name not in PERTURBATIONS:
            raise PisftError(f"unknown perturbation {self.name!r}; one of {', '.join(PERTURBATIONS)}")

    @property
    def active(self) -> bool:
        """Strength 0 leaves an episode exactly as it is: nothing is drawn or applied."""
        return self.strength != 0

    @property
    def key(self) -> str:
        """Its name in metrics.json and the videos' folder (`pisft.config.perturbation_key`)."""
        return perturbation_key(self.name, self.strength)

    def label(self) -> str:
        """How the report names it: `camera 10°`, `lighting x1.5`, `obs_noise std 0.05x255`."""
        s = self.strength
        return {"camera": f"camera {s:g}°", "lighting": f"lighting x{1 + s:g}", "robot_init": f"robot_init {s:g} rad",
                "object_position": f"object_position {s:g} m",
                "language": "language: LIBERO-Pro's paraphrase" if s else "language 0",
                "obs_noise": f"obs_noise std {s:g}x255"}[self.name]


def paraphrase(suite: str, task_name: str | None) -> str | None:
    """LIBERO-Pro's paraphrase of a task's instruction (`pisft.rollout.paraphrases`), None if it has none."""
    return PARAPHRASES.get((suite, task_name)) if task_name else None


def _generator(p: Perturbation, seed: int, suite: str, task_id: int, init_state: int,
               *more: int) -> np.random.Generator:
    words = [int(seed), int(task_id), int(init_state), *(ord(c) for c in suite), *(ord(c) for c in p.name), *more]
    return np.random.default_rng(np.random.SeedSequence(words))


def for_episode(p: Perturbation | None, *, seed: int, suite: str, task_id: int,
                init_state: int) -> EpisodePerturbation | None:
    """The episode's perturbation, or None when there is none or its strength is 0."""
    if p is None or not p.active:
        return None
    return EpisodePerturbation(p, seed=seed, suite=suite, task_id=task_id, init_state=init_state)


@dataclass
class EpisodePerturbation:
    """One episode's draw of a perturbation; `record` says what was applied (episodes.jsonl)."""

    p: Perturbation
    seed: int
    suite: str
    task_id: int
    init_state: int
    record: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.record = {"name": self.p.name, "strength": self.p.strength}

    def _rng(self, *more: int) -> np.random.Generator:
        return _generator(self.p, self.seed, self.suite, self.task_id, self.init_state, *more)

    def initial_state(self, env: Any, state: Any) -> Any:
        """The episode's initial state (LIBERO's flattened MuJoCo state: time, qpos, qvel) as this perturbation
        makes it, with the camera or the lights of `env`'s freshly reset model changed; called between
        the reset and `set_init_state`, so LIBERO sets and observes it as it does any initial state."""
        name = self.p.name
        if name not in SCENE:
            return state
        scene = _Scene(env, name)
        state = np.array(state, dtype=np.float64, copy=True)
        if name == "camera":
            self.record.update(scene.orbit_camera(self.p.strength, self._rng(), state))
        elif name == "lighting":
            self.record.update(scene.scale_lights(1.0 + self.p.strength))
        elif name == "robot_init":
            self.record.update(scene.move_arm(self.p.strength, self._rng(), state))
        else:
            self.record.update(scene.move_objects(self.p.strength, self._rng(), state))
        return state

    def begin(self, obs: dict, task: Any) -> tuple[dict, str]:
        """The episode's first observation and its prompt, once LIBERO has set the initial state."""
        prompt = task.language
        if self.p.name == "language":
            prompt = paraphrase(self.suite, getattr(task, "name", None))
            if prompt is None:
                raise PisftError(f"perturbation 'language': LIBERO-Pro has no paraphrase of {self.suite} task "
                                 f"{self.task_id} ({task.language!r}); it covers libero_spatial, libero_object, "
                                 "libero_goal and libero_10 (pisft.rollout.paraphrases)")
            self.record["prompt"] = prompt
        elif self.p.name == "obs_noise":
            self.record["std"] = self.p.strength * 255.0
        return self.observe(obs, 0), prompt

    def observe(self, obs: dict, step: int) -> dict:
        """The observation after `step` simulator steps (0: the initial state), as the policy sees it."""
        if self.p.name != "obs_noise":
            return obs
        rng = self._rng(step)
        out = dict(obs)
        std = np.float32(self.p.strength * 255.0)
        for key in IMAGES:
            image = libero_sim.to_uint8(np.asarray(obs[key]))
            noise = rng.standard_normal(image.shape, dtype=np.float32) * std
            out[key] = np.clip(np.rint(image.astype(np.float32) + noise), 0, 255).astype(np.uint8)
        return out


class _Scene:
    """LIBERO's MuJoCo model behind an environment and an initial state to perturb (robosuite 1.4.0's
    `MjSim`: `model._model` and `data._data` are MuJoCo's own `MjModel` and `MjData`; LIBERO's initial
    states are `MjSimState.from_flattened`'s layout: time, qpos, qvel)."""

    def __init__(self, env: Any, name: str) -> None:
        sim = getattr(env, "sim", None)
        if sim is None or not hasattr(sim, "model") or not hasattr(getattr(env, "env", None), "objects_dict"):
            raise PisftError(f"perturbation '{name}' edits LIBERO's MuJoCo scene, and this simulator's environment "
                             f"({type(env).__module__}.{type(env).__qualname__}) has none: run it in the LIBERO "
                             "simulator, or use language or obs_noise")
        import mujoco

        self.mj, self.env = mujoco, env
        # MuJoCo's own MjModel and MjData under robosuite's wrappers (binding_utils.MjModel / MjData)
        self.m, self.d = sim.model._model, sim.data._data  # noqa: SLF001

    def _qpos(self, state: np.ndarray) -> np.ndarray:
        """The qpos part of a flattened state (a view: writing it edits the state)."""
        return state[1:1 + self.m.nq]

    def _free_joints(self) -> list[tuple[str, int, int]]:
        """(object, joint id, qpos address) of every movable object of the task (a free joint)."""
        out = []
        for obj_name, obj in self.env.env.objects_dict.items():
            joints = list(getattr(obj, "joints", []) or [])
            if not joints:
                continue
            jid = self.mj.mj_name2id(self.m, self.mj.mjtObj.mjOBJ_JOINT, joints[0])
            if jid >= 0 and self.m.jnt_type[jid] == self.mj.mjtJoint.mjJNT_FREE:
                out.append((obj_name, jid, int(self.m.jnt_qposadr[jid])))
        return out

    # -- camera ---------------------------------------------------------------------------------
    def orbit_camera(self, degrees: float, rng: np.random.Generator, state: np.ndarray) -> dict:
        mj, m = self.mj, self.m
        cid = mj.mj_name2id(m, mj.mjtObj.mjOBJ_CAMERA, CAMERA)
        if cid < 0 or m.cam_bodyid[cid] != 0:
            raise PisftError(f"perturbation 'camera': LIBERO's '{CAMERA}' camera is missing or not fixed in the world "
                             "in this scene; the orbit is defined for a world camera")
        pos, quat = m.cam_pos[cid].copy(), m.cam_quat[cid].copy()
        frame = np.zeros(9)
        mj.mju_quat2Mat(frame, quat)
        frame = frame.reshape(3, 3)  # columns: the camera's right, up and back axes (it looks along -back)
        right, up, view = frame[:, 0], frame[:, 1], -frame[:, 2]
        qpos = self._qpos(state)
        movable = self._free_joints()
        centre = np.mean([qpos[adr:adr + 3] for _, _, adr in movable], axis=0) if movable else pos + view
        look_at = pos + max(float(np.dot(centre - pos, view)), 0.1) * view
        direction = float(rng.uniform(0.0, 2.0 * math.pi))
        axis = math.cos(direction) * up + math.sin(direction) * right
        turn = np.zeros(4)
        mj.mju_axisAngle2Quat(turn, axis, math.radians(degrees))
        offset = np.zeros(3)
        mj.mju_rotVecQuat(offset, pos - look_at, turn)
        new_quat = np.zeros(4)
        mj.mju_mulQuat(new_quat, turn, quat)
        mj.mju_normalize4(new_quat)
        m.cam_pos[cid] = look_at + offset
        m.cam_quat[cid] = new_quat
        return {"direction_deg": math.degrees(direction), "look_at": [float(x) for x in look_at],
                "moved_m": float(np.linalg.norm(m.cam_pos[cid] - pos))}

    # -- lighting -------------------------------------------------------------------------------
    def scale_lights(self, factor: float) -> dict:
        m = self.m
        for colour in (m.light_diffuse, m.light_ambient, m.light_specular):
            colour *= factor
        head = m.vis.headlight
        head.diffuse, head.ambient, head.specular = head.diffuse * factor, head.ambient * factor, head.specular * factor
        return {"intensity_factor": factor, "lights": int(m.nlight)}

    # -- contacts -------------------------------------------------------------------------------
    def _pressed(self, state: np.ndarray) -> set[tuple[int, int]]:
        """Pairs of kinematic trees (root bodies) pressed into each other deeper than PENETRATION_M in
        `state` (set into the simulation's data for MuJoCo's collision detection: `set_init_state` sets
        the episode's state over it, and `mj_forward` leaves nothing a later step reads)."""
        m, d = self.m, self.d
        d.time = state[0]
        d.qpos[:] = state[1:1 + m.nq]
        d.qvel[:] = state[1 + m.nq:1 + m.nq + m.nv]
        self.mj.mj_forward(m, d)
        root = m.body_rootid
        pairs = set()
        for i in range(d.ncon):
            c = d.contact[i]
            if c.dist < -PENETRATION_M:
                a, b = int(root[m.geom_bodyid[c.geom1]]), int(root[m.geom_bodyid[c.geom2]])
                pairs.add((min(a, b), max(a, b)))
        return pairs

    def _presses_new(self, state: np.ndarray, before: set[tuple[int, int]], tree: int) -> bool:
        return any(tree in pair for pair in self._pressed(state) - before)

    # -- robot_init -----------------------------------------------------------------------------
    def move_arm(self, norm: float, rng: np.random.Generator, state: np.ndarray) -> dict:
        mj, m = self.mj, self.m
        robot = self.env.robots[0]
        joints = [mj.mj_name2id(m, mj.mjtObj.mjOBJ_JOINT, j) for j in robot.robot_joints]
        adrs = [int(m.jnt_qposadr[j]) for j in joints]
        qpos = self._qpos(state)
        start = qpos[adrs].copy()
        limited = m.jnt_limited[joints].astype(bool)
        low = np.where(limited, m.jnt_range[joints, 0], -np.inf)
        high = np.where(limited, m.jnt_range[joints, 1], np.inf)
        tree = int(m.body_rootid[m.jnt_bodyid[joints[0]]])
        before = self._pressed(state)
        for draw in range(1, DRAWS + 1):
            direction = rng.standard_normal(len(joints))
            offset = norm * direction / np.linalg.norm(direction)
            if np.all(start + offset >= low) and np.all(start + offset <= high):
                qpos[adrs] = start + offset
                if not self._presses_new(state, before, tree):
                    # the pose the arm rests in: OSC's nullspace target (robosuite 1.4.0 controllers/osc.py,
                    # update_initial_joints), else the controller pulls the redundant joints back to LIBERO's
                    robot.controller.update_initial_joints(start + offset)
                    return {"joint_offset_rad": [float(x) for x in offset], "draws": draw}
                qpos[adrs] = start
        raise PisftError(f"perturbation 'robot_init': no offset of norm {norm:g} rad within {DRAWS} draws keeps the "
                         f"arm's joints in their limits and off the scene ({type(self.env.env).__name__}); use a "
                         "smaller strength")

    # -- object_position ------------------------------------------------------------------------
    def move_objects(self, distance: float, rng: np.random.Generator, state: np.ndarray) -> dict:
        m = self.m
        qpos = self._qpos(state)
        moved, stayed = {}, []
        for obj_name, jid, adr in self._free_joints():
            tree = int(m.body_rootid[m.jnt_bodyid[jid]])
            before = self._pressed(state)
            start = qpos[adr:adr + 2].copy()
            for _ in range(DRAWS):
                angle = float(rng.uniform(0.0, 2.0 * math.pi))
                shift = distance * np.array([math.cos(angle), math.sin(angle)])
                qpos[adr:adr + 2] = start + shift
                if not self._presses_new(state, before, tree):
                    moved[obj_name] = [float(x) for x in shift]
                    break
            else:
                qpos[adr:adr + 2] = start
                stayed.append(obj_name)
        return {"moved_xy_m": moved, "stayed": stayed}
