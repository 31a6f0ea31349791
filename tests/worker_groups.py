"""Which pytest-xdist worker runs which tests (`make test`: `-n $(TEST_WORKERS) --dist loadscope`,
the Makefile's).

A single test seldom keeps both of CI's cores busy (the simulator, Snakemake, DVC and Slurm's
polling run on one, and a Slurm test waits for the job's time limit), so more workers than cores
fill them (docs/development.md, "Tests"). Two things must stay on one worker:
- a test file, whole and in its order, so that its module fixtures are built once;
- the tests of a session fixture that runs a whole pipeline (PIPELINE_TESTS), so that the
  pipeline runs once. Those groups are the longest, so they are handed out first.

xdist's own `--dist loadgroup` cannot do this here: it renames the collected items, which
pytest 9.2 no longer allows (xdist 3.8.0 sets `item._nodeid`; pytest 9.2's `Node.nodeid`
reads `_id`), so its groups silently fall apart into single tests. The group of a test is
therefore computed from its node id by the scheduler below, and the workers check that the
table matches the fixtures the tests ask for.

Every process that collects (a worker, or a run without xdist) also checks the `integration`
mark: a test that asks for a fixture of PIPELINE_FIXTURES, directly or through another fixture,
without the mark fails before the fixture is built, naming the test and the fix, because
`make test-fast` (`-m "not integration"`) would otherwise run a whole pipeline.
"""

from __future__ import annotations

import pytest

# Session fixture -> the test files, or single tests, that use it (tests/conftest.py, tests/dvc_fixtures.py).
PIPELINE_TESTS = {
    "default_pipeline": (
        "tests/test_integration_pipeline.py", "tests/test_orchestration.py", "tests/test_robust_recap.py",
        "tests/test_terminal.py",
        "tests/test_dvc.py::test_after_snakemake_dvc_is_up_to_date_and_a_pull_restores_every_output",
        "tests/test_rollout_chunking.py::test_rtc_lowers_the_jerk_of_the_trained_model_at_chunk_boundaries",
        "tests/test_rollout_shards.py::test_snakemake_runs_a_job_per_shard_and_reruns_only_a_lost_shard",
    ),
    # test_slurm compares its Slurm run with it; test_slurm_shards runs the closed loop and a RECAP collection
    # on its trained model
    "dvc_run": ("tests/test_dvc.py", "tests/test_slurm.py", "tests/test_slurm_shards.py"),
}
# Fixtures that run the workflow's drivers over the DAG (minutes each): the tests that use them carry
# @pytest.mark.integration. Fixture -> the test files it serves ("tests/": any, a session fixture).
PIPELINE_FIXTURES = {
    "default_pipeline": "tests/",  # conftest.py: the whole pipeline through Snakemake
    "dvc_run": "tests/",  # dvc_fixtures.py: the small SFT DAG through `dvc repro`
    "slurm_two_nodes": "tests/",  # slurm_fixtures.py: a two-node Slurm cluster (installs, daemons, namespaces)
    "two_node_run": "tests/test_slurm.py",  # the small SFT DAG, every rule a Slurm job of that cluster
    "project": "tests/test_robust_drivers.py",  # `dvc repro convert_recap` on the small settings
}
DISTRIBUTED = ("load", "loadscope", "loadfile", "loadgroup")  # xdist's modes this grouping replaces
MISPLACED = pytest.StashKey[str]()  # why a test is not placed with its pipeline (it then fails)
UNMARKED = pytest.StashKey[str]()  # why a test must carry the integration mark (it then fails)


def group_of(nodeid: str) -> str:
    """The pipeline whose entry matches `nodeid` most closely (a test before its file), else
    the test's file."""
    test = nodeid.split("[", 1)[0]
    path = test.split("::", 1)[0]
    for key in (test, path):
        for pipeline, entries in PIPELINE_TESTS.items():
            if key in entries:
                return pipeline
    return path


def unmarked_pipeline_test(item) -> str | None:
    """Why `item` fails: it uses a fixture of PIPELINE_FIXTURES without the integration mark."""
    if item.get_closest_marker("integration") is not None:
        return None
    used = [name for name, where in PIPELINE_FIXTURES.items()
            if name in item.fixturenames and item.nodeid.startswith(where)]
    if not used:
        return None
    return (f"{item.nodeid} uses {', '.join(used)} (a whole pipeline run, minutes) without "
            "@pytest.mark.integration, so `make test-fast` (-m \"not integration\") would run it: add "
            "@pytest.mark.integration to the test (or pytestmark = pytest.mark.integration to its module); "
            "the fixtures are PIPELINE_FIXTURES in tests/worker_groups.py")


def pytest_collection_modifyitems(config, items):
    """Mark a pipeline test without the integration mark (it fails, saying so). On a worker also:
    mark a pipeline test that the table does not place with its pipeline (it fails, saying so),
    then put the pipeline groups first (a stable sort: every file keeps its order)."""
    for item in items:
        if problem := unmarked_pipeline_test(item):
            item.stash[UNMARKED] = problem
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        for pipeline in PIPELINE_TESTS:
            if pipeline in item.fixturenames and group_of(item.nodeid) != pipeline:
                item.stash[MISPLACED] = (
                    f"{item.nodeid} uses the session fixture {pipeline} but would run apart from its other "
                    f"tests (and build it again): add its file or test to PIPELINE_TESTS[{pipeline!r}] in "
                    "tests/worker_groups.py")
    items.sort(key=lambda item: group_of(item.nodeid) not in PIPELINE_TESTS)


@pytest.hookimpl(tryfirst=True)  # before the runner's own set-up builds the fixtures
def pytest_runtest_setup(item):
    for problem in (UNMARKED, MISPLACED):
        if problem in item.stash:
            pytest.fail(item.stash[problem], pytrace=False)


class PipelineScheduling:
    """The plugin that gives xdist its scheduler, registered only where xdist is loaded (its hook
    is unknown to pytest without it, e.g. under `-p no:xdist`)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        """xdist's scope scheduler with the groups of `group_of` as its scopes."""
        if config.getvalue("dist") not in DISTRIBUTED:
            return None
        from xdist.scheduler import LoadScopeScheduling

        class PipelineGroups(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        return PipelineGroups(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(PipelineScheduling(), "pisft-worker-groups")
