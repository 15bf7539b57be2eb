"""The Ray Serve deployment: settings and health logic (fast, no Ray needed), and a real local Ray
cluster on 127.0.0.1 serving the tiny model through Serve's HTTP ingress (slow; skipped without
`ray[serve]`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.gateway.fakes import free_port
from tests.gateway.load import wait_http_ready
from tokenmill.deploy.ray_serve import RayDeploySettings, TokenmillReplica
from tokenmill.errors import TokenmillError


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
    replica.settings = RayDeploySettings(model="m", unhealthy_after_s=0.2)
    replica.server_state = SimpleNamespace(not_ready_reason=lambda: reason[0])
    replica._unready_since = None
    replica.check_health()
    reason[0] = "draining"
    replica.check_health()  # Ray is shutting it down: healthy
    reason[0] = "engine restarting"
    replica.check_health()  # within the grace period
    time.sleep(0.25)
    with pytest.raises(RuntimeError, match="engine restarting"):
        replica.check_health()
    reason[0] = None
    replica.check_health()


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
