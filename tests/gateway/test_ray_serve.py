"""The Ray Serve deployment: settings and health logic (fast, no Ray needed), and a real local Ray
cluster on 127.0.0.1 serving the tiny model through Serve's HTTP ingress (slow; skipped without
`ray[serve]`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.fakes import free_port, wait_until
from tests.gateway.load import wait_http_ready
from tokenmill.deploy.ray_serve import RayDeploySettings, TokenmillReplica
from tokenmill.deploy.stop import StopSignals
from tokenmill.errors import TokenmillError

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_settings_map_to_serve_autoscaling_and_refuse_unknown_keys() -> None:
    settings = RayDeploySettings.from_dict({"model": "m", "min_replicas": 2, "max_replicas": 6,
                                            "target_ongoing_requests": 8, "num_gpus": 1})
    options = settings.deployment_options()
    assert options["autoscaling_config"]["min_replicas"] == 2  # the warm buffer
    assert options["autoscaling_config"]["target_ongoing_requests"] == 8
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    with pytest.raises(TokenmillError, match="unknown"):
        RayDeploySettings.from_dict({"model": "m", "replicas": 3})
    with pytest.raises(TokenmillError):
        RayDeploySettings(model="m", min_replicas=3, max_replicas=2)


def test_health_check_tolerates_a_short_engine_restart_but_not_a_long_one() -> None:
    replica = TokenmillReplica.__new__(TokenmillReplica)  # no engine: only the health logic
    reason: list[str | None] = [None]
    now = [0.0]
    replica.clock = lambda: now[0]  # type: ignore[method-assign]
    replica.settings = RayDeploySettings(model="m", unhealthy_after_s=30.0)
    replica.server_state = SimpleNamespace(not_ready_reason=lambda: reason[0])
    replica._unready_since = None
    replica.check_health()
    reason[0] = "draining"
    now[0] = 100.0
    replica.check_health()  # Ray is shutting it down: healthy, however long it takes
    reason[0] = "engine restarting"
    now[0] = 200.0  # the grace period starts here, not at the draining
    replica.check_health()
    now[0] = 230.0
    replica.check_health()  # exactly the grace period: still tolerated
    now[0] = 230.5
    with pytest.raises(RuntimeError, match=r"unready for \d+ s: engine restarting"):
        replica.check_health()
    reason[0] = None
    replica.check_health()  # recovered: the next restart gets a full grace period again
    reason[0] = "engine restarting"
    now[0] = 300.0
    replica.check_health()
    now[0] = 329.0
    replica.check_health()


class FakeSignals:
    """Stands in for signal.signal and os._exit: records handlers, lets a test deliver a signal."""

    def __init__(self) -> None:
        self.handlers: dict[int, Callable[[int, Any], None]] = {}
        self.installs: list[int] = []
        self.exits: list[int] = []

    def install(self, signum: int, handler: Callable[[int, Any], None]) -> None:
        self.handlers[signum] = handler
        self.installs.append(signum)

    def deliver(self, signum: int) -> None:
        self.handlers[signum](signum, None)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_both_stop_the_wait_and_a_second_one_forces_the_exit(signum: int) -> None:
    fake = FakeSignals()
    stop = StopSignals(install_handler=fake.install, force_exit=fake.exits.append)
    stop.install()
    assert set(fake.handlers) == {signal.SIGINT, signal.SIGTERM}
    threading.Timer(0.05, fake.deliver, (signum,)).start()
    assert stop.wait(poll_s=0.01) == signum
    assert fake.exits == []
    fake.deliver(signal.SIGINT)  # impatient: the shutdown is taking too long
    assert fake.exits == [128 + signal.SIGINT]


def test_deploy_ray_shuts_the_application_down_on_the_stop_signal(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli import build_parser
    from tokenmill.cli.deploy import run_deploy_ray
    from tokenmill.deploy import ray_serve

    events: list[str] = []
    fake = FakeSignals()

    def fake_deploy(settings: RayDeploySettings, **where: Any) -> str:
        events.append(f"deploy {settings.model} {where['port']}")
        assert set(fake.handlers) == {signal.SIGINT, signal.SIGTERM}  # a Ctrl-C while deploying counts
        fake.installs.clear()  # ray.init replaces the SIGTERM handler: they must be installed again
        return f"http://127.0.0.1:{where['port']}"

    monkeypatch.setattr(ray_serve, "deploy", fake_deploy)
    monkeypatch.setattr(ray_serve, "shutdown", lambda: events.append("shutdown"))
    stop = StopSignals(install_handler=fake.install, force_exit=fake.exits.append)
    threading.Timer(0.05, lambda: fake.deliver(signal.SIGINT)).start()
    args = build_parser().parse_args(["deploy", "ray", "m", "--port", "8123"])
    assert run_deploy_ray(args, stop) == 0
    assert events == ["deploy m 8123", "shutdown"]
    assert sorted(fake.installs) == sorted([signal.SIGINT, signal.SIGTERM])
    assert "serving on http://127.0.0.1:8123/v1 (Ctrl-C to stop)" in capsys.readouterr().out


FAKE_DEPLOY = """
import sys
import tokenmill.deploy.ray_serve as ray_serve
from tokenmill.cli.main import main
ray_serve.deploy = lambda settings, **where: "http://127.0.0.1:1"
ray_serve.shutdown = lambda: print("SHUTDOWN", flush=True)
sys.exit(main(["deploy", "ray", "m"]))
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a non-interactive shell does


def test_sigint_stops_deploy_ray_even_when_started_in_the_background() -> None:
    """The reported bug: started with SIGINT ignored (a background job), `kill -INT` did nothing."""
    proc = subprocess.Popen([sys.executable, "-c", FAKE_DEPLOY], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_ignore_sigint)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "Ctrl-C to stop" in first, first
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert "SHUTDOWN" in proc.stdout.read()
    finally:
        proc.kill()


@pytest.mark.slow
def test_ray_serve_on_a_local_cluster_serves_the_openai_api(tiny_hf_dir: Callable[[str], Path]) -> None:
    pytest.importorskip("ray.serve")
    from tokenmill.deploy.ray_serve import build_application, deploy, shutdown

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    settings = RayDeploySettings(model=str(tiny_hf_dir("llama")), served_model_name="tiny", dtype="float32",
                                 device="cpu", num_kv_blocks=64, threads=1, min_replicas=1, max_replicas=2,
                                 num_cpus=0.5, target_ongoing_requests=2, health_check_period_s=1.0)
    config = build_application(settings)._bound_deployment._deployment_config
    assert config.autoscaling_config.min_replicas == 1 and config.autoscaling_config.target_ongoing_requests == 2
    started = time.monotonic()
    url = deploy(settings, address=None, host="127.0.0.1", port=free_port(),
                 ray_init_options={"num_cpus": 2, "include_dashboard": False, "_node_ip_address": "127.0.0.1"})
    try:
        wait_http_ready(url, timeout_s=120)
        print(f"\nRay Serve: local cluster + deployment ready in {time.monotonic() - started:.1f} s")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        completion = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True, extra_body={"ignore_eos": True})
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
        assert "tokenmill:num_requests_running" in httpx.get(f"{url}/metrics").text
    finally:
        shutdown()


@pytest.mark.slow
def test_sigint_stops_deploy_ray_and_its_local_ray_cluster(tiny_hf_dir: Callable[[str], Path]) -> None:
    """The real command, started as a background job (SIGINT ignored): SIGINT stops it and every
    process of the local Ray cluster it started."""
    pytest.importorskip("ray.serve")
    psutil = pytest.importorskip("psutil")
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "deploy", "ray", str(tiny_hf_dir("llama")), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--threads", "1", "--num-cpus", "0.5"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_ignore_sigint)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("Ctrl-C to stop" in line for line in lines) or proc.poll() is not None,
                   timeout_s=180, what="the deployment")
        wait_http_ready(f"http://127.0.0.1:{port}", timeout_s=30)
        cluster = psutil.Process(proc.pid).children(recursive=True)
        assert cluster, "ray.init started no local cluster processes"
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        print(f"\ndeploy ray: exited {time.monotonic() - started:.1f} s after SIGINT")
        _, alive = psutil.wait_procs(cluster, timeout=30)
        assert not alive, f"left running: {[p.name() for p in alive]}"
    finally:
        proc.kill()
        reader.join(timeout=10)
        print("".join(lines)[-3000:])
