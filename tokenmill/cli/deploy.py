"""`tokenmill deploy ray MODEL`: run replicas as a Ray Serve application (multi-node; docs/deploy.md).

    tokenmill deploy ray smollm2-135m --address auto --min-replicas 2 --max-replicas 8
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

from tokenmill.deploy.stop import StopSignals


def add_deploy_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("deploy", help="run tokenmill on a distributed serving system")
    targets = parser.add_subparsers(dest="target", required=True, metavar="target")
    ray = targets.add_parser("ray", help="Ray Serve: replicas as an autoscaling deployment")
    ray.add_argument("model", help="catalog name, .gguf file or Hugging Face directory (on every node)")
    ray.add_argument("--address", default=None,
                     help="Ray cluster: 'auto' (the one this node belongs to), ray://HEAD:10001, "
                          "or none to start a local one")
    ray.add_argument("--host", default="127.0.0.1", help="where Serve's HTTP proxy binds (0.0.0.0 for a cluster)")
    ray.add_argument("--port", type=int, default=8000)
    ray.add_argument("--served-model-name", default=None)
    ray.add_argument("--min-replicas", type=int, default=1, help="the warm buffer: replicas kept when idle")
    ray.add_argument("--max-replicas", type=int, default=4)
    ray.add_argument("--target-ongoing-requests", type=float, default=16.0,
                     help="Ray adds replicas while ongoing requests per replica exceed this")
    ray.add_argument("--num-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    ray.add_argument("--num-gpus", type=float, default=0.0, help="GPUs reserved per replica")
    ray.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ray.add_argument("--device", default="auto")
    ray.add_argument("--max-model-len", type=int, default=None)
    ray.add_argument("--num-kv-blocks", type=int, default=None)
    ray.add_argument("--max-num-seqs", type=int, default=64)
    ray.add_argument("--threads", type=int, default=None, help="torch threads per replica")
    ray.set_defaults(handler=run_deploy_ray)


def settings_from_args(args: argparse.Namespace) -> Any:
    from tokenmill.deploy.ray_serve import RayDeploySettings

    return RayDeploySettings(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        threads=args.threads, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, num_cpus=args.num_cpus, num_gpus=args.num_gpus)


def run_deploy_ray(args: argparse.Namespace, stop: StopSignals | None = None) -> int:
    """Deploy, print the URL, and keep the application up until SIGINT/SIGTERM (deploy/stop.py)."""
    from tokenmill.deploy.ray_serve import deploy, shutdown

    stop = stop or StopSignals()
    stop.install()  # a signal during the deploy is kept, and acted on once it returns
    url = deploy(settings_from_args(args), address=args.address, host=args.host, port=args.port)
    try:
        stop.install()  # again: ray.init replaces the SIGTERM handler when it starts a local cluster
        print(f"serving on {url}/v1 (Ctrl-C to stop)", flush=True)
        signum = stop.wait()
        print(f"{signal.Signals(signum).name}: shutting down the application", flush=True)
    finally:
        shutdown()
    return 0
