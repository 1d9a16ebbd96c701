"""Shared test setup: markers, the tiny-checkpoint cache, CPU-friendly vLLM defaults, and the process-group
fixture `dist_world` of every test that builds a diffusion model (tests/diffusion and tests/models alike), and
`shared_server`, the live `vllm serve` processes that several modules share; and the per-module set-up budget
(tests/setup_budget.toml), which fails the run when a module's set-up grows past it."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from vllm_omni.envs import ENGINE_CORE_FORKS_WORKERS

# vLLM CPU: keep the KV cache small so several engines fit beside each other on a 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
    # What our front end sets where the user chose no start method (async_omni_engine.py), so every test process
    # and server starts its stages as a user's does: the stage processes spawned (this process runs threads), each
    # core forking its workers.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    os.environ[ENGINE_CORE_FORKS_WORKERS] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


WORKER_UNITS: dict[str, tuple[str, ...]] = {
    # Packages (directories with an __init__.py: in one without, pytest keeps a "package" fixture to the end of the
    # session) with package-scoped fixtures in their conftest.py: a worker tears such a fixture down only when its
    # next test is outside the package, so a package split over units would keep its engine or cluster running
    # beside the next unit's tests (whose leak checks would find its processes).
    "tiny Qwen3-Omni engine": ("tests/models/qwen3_omni/",),
    "tiny Qwen3-TTS engine": ("tests/models/qwen3_tts/",),
    "Ray cluster": ("tests/ray_cluster/",),
    # The users of each `shared_server` server (tests/entrypoints/openai/live_server.py names them).
    "shared tiny/qwen2 server": ("tests/reliability/test_live_bad_input.py", "tests/tools/test_vllm_cli.py",
                                 "tests/entrypoints/openai/test_live_vllm_app.py"),
    "shared long Qwen-Image and Wan servers": ("tests/reliability/test_soak_disconnects.py",
                                               "tests/reliability/test_abort_real_pipelines.py",
                                               "tests/entrypoints/openai/test_videos_live.py"),
    "shared tiny/ltx-2 server": ("tests/models/ltx2/test_ltx2_serve.py",),
}
"""What one pytest-xdist worker runs together (tools/test.sh runs two), so that an engine or server its tests share
starts once; every other module is a unit of its own."""


def worker_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return next((name for name, prefixes in WORKER_UNITS.items() if module.startswith(prefixes)), module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's load-scope scheduling with WORKER_UNITS as its scopes (`--dist loadscope`; other modes keep
    pytest-xdist's own scheduler)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkerUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # pytest-xdist's point of extension for its scope schedulers
            return worker_unit(nodeid)

    return WorkerUnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests for the workers (every worker collects, in the same order) and skip `cuda` ones without a
    GPU."""
    unlisted = sorted({item.nodeid.split("::", 1)[0] for item in items
                       if "shared_server" in item.fixturenames and worker_unit(item.nodeid) not in WORKER_UNITS})
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py WORKER_UNITS: add {unlisted}, which use `shared_server`, to the "
                                "unit of the other users of their server")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _largest_units_first(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
"""Each module's seconds (set-up + calls + teardown) in a two-worker run, for ordering the units; rewrite it from
a run's `--setup-times-json` file when the suite's shape changes (a module missing from it counts 0)."""


def _largest_units_first(items: list[pytest.Item]) -> None:
    """The longest units first: one started last would leave the other worker idle."""
    seconds = json.loads(MODULE_SECONDS.read_text())
    weight: dict[str, float] = {}
    for module in {item.nodeid.split("::", 1)[0] for item in items}:
        unit = worker_unit(module)
        weight[unit] = weight.get(unit, 0.0) + seconds.get(module, 0.0)
    order = {unit: rank for rank, unit in enumerate(dict.fromkeys(worker_unit(item.nodeid) for item in items))}
    items.sort(key=lambda item: (-weight[worker_unit(item.nodeid)], order[worker_unit(item.nodeid)]))


@pytest.fixture(scope="module")
def dist_world():
    """A gloo world of size 1 with vLLM's model-parallel groups and a current VllmConfig, for the module.

    vLLM's parallel linear layers need these groups even at tensor-parallel size 1. A module that finds groups
    already set up (by an earlier module in the same process) reuses them and leaves them to their owner.
    """
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        init_diffusion_distributed,
    )

    if model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            yield
        return
    config = init_diffusion_distributed(
        rank=0, world_size=1, parallel_config=DiffusionParallelConfig(), device=torch.device("cpu")
    )
    try:
        with set_current_vllm_config(config):
            yield
    finally:
        destroy_diffusion_distributed()


@pytest.fixture(scope="session")
def shared_server():
    """`shared_server(model, *args)`: one live `vllm serve model --omni *args` per distinct (model, args), shared
    by every module that asks for it (tests/entrypoints/openai/live_server.py names the shared ones).

    A start costs 10-40 s of CI, so modules that only send requests share a server; modules that kill, restart or
    sleep theirs keep their own. Each is started on first use (again if an earlier user left it dead) and
    SIGTERMed at the end of the session, which must leave no process behind, as each module used to check.
    """
    from tests.entrypoints.openai.live_server import LiveServer

    servers: dict[tuple[str, ...], LiveServer] = {}

    def get(model: str, *args: str) -> LiveServer:
        key = (model, *args)
        if key in servers and servers[key].proc.poll() is not None:
            servers.pop(key).close()
        if key not in servers:
            servers[key] = LiveServer(model, *args)
        return servers[key]

    yield get
    for srv in servers.values():  # all at once: each takes seconds to stop its engine
        srv.terminate()
    unclean = [str(srv.log) for srv in servers.values() if not srv.close()]
    assert not unclean, f"shared servers did not shut down cleanly on SIGTERM; logs: {unclean}"


@pytest.fixture(scope="session")
def stop_later():
    """`stop_later(server)`: SIGTERM a module's own live server at its end and check at the end of the session
    that it exited cleanly, leaving no process behind.

    A server takes seconds to stop (an AR one ~10 s: vLLM's CPU worker outlives its 5 s shutdown grace); the next
    modules run meanwhile instead of waiting for it.
    """
    stopping = []

    def stop(server) -> None:
        server.terminate()
        stopping.append(server)

    yield stop
    unclean = [str(srv.log) for srv in stopping if not srv.close()]
    assert not unclean, f"servers did not shut down cleanly on SIGTERM; logs: {unclean}"


SETUP_BUDGET = Path(__file__).with_name("setup_budget.toml")
XDIST_BUDGET_SCALE = 1.5


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("setup budget")
    group.addoption("--setup-budget-scale", type=float, default=os.environ.get("SETUP_BUDGET_SCALE"),
                    help="Multiply every per-module set-up budget of tests/setup_budget.toml (0 turns the check "
                         "off); for a machine slower than CI's. Default: $SETUP_BUDGET_SCALE, else 1 in one pytest "
                         f"process and {XDIST_BUDGET_SCALE:g} under pytest-xdist (tools/test.sh's two workers "
                         "share the 2 CPUs, so a set-up that starts several processes gets about half of them).")
    group.addoption("--setup-times-json", default=os.environ.get("SETUP_TIMES_JSON"),
                    help="Write each module's set-up, call and teardown seconds to this JSON file.")


class SetupBudget:
    """A plugin: seconds each test module spent in set-up, calls and teardown (the report phases of its tests; a
    shared session fixture counts in the module that first asks for it), against tests/setup_budget.toml.

    A module whose set-up outgrows its budget fails the run, so a new server start or a slower fixture is a
    decision someone writes into the table, not CI minutes that creep in."""

    def __init__(self, config: pytest.Config) -> None:
        table = tomllib.loads(SETUP_BUDGET.read_text())
        self.default_s = float(table["default_s"])
        self.budgets = {name: float(s) for name, s in table.get("modules", {}).items()}
        scale = config.getoption("--setup-budget-scale")
        workers = config.getoption("numprocesses", None)
        self.scale = float(scale) if scale is not None else XDIST_BUDGET_SCALE if workers else 1.0
        self.json_path = config.getoption("--setup-times-json")
        self.times: dict[str, dict[str, float]] = {}
        self.over: list[tuple[str, float, float]] = []

    def budget(self, module: str) -> float:
        return self.budgets.get(module, self.default_s) * self.scale

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        phases = self.times.setdefault(report.nodeid.split("::", 1)[0], {"setup": 0.0, "call": 0.0, "teardown": 0.0})
        phases[report.when] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.json_path:
            Path(self.json_path).write_text(json.dumps(self.times, indent=1, sort_keys=True))
        if self.scale > 0:
            self.over = [(module, t["setup"], self.budget(module)) for module, t in self.times.items()
                         if t["setup"] > self.budget(module)]
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.times:
            return
        tr = terminalreporter
        slowest = sorted(self.times.items(), key=lambda kv: -sum(kv[1].values()))[:25]
        tr.write_sep("=", "slowest 25 modules (set-up / calls / teardown, s)")
        for module, t in slowest:
            tr.write_line(f"{t['setup']:8.1f} {t['call']:8.1f} {t['teardown']:8.1f}  {module}")
        for module, setup_s, budget_s in self.over:
            tr.write_line(f"SET-UP BUDGET EXCEEDED: {module} spent {setup_s:.1f} s in set-up, budget {budget_s:.1f} s "
                          f"(tests/setup_budget.toml; --setup-budget-scale={self.scale:g})", red=True, bold=True)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # under pytest-xdist the controller sees every worker's reports
        config.pluginmanager.register(SetupBudget(config), "setup-budget")
