"""`tokenmill gateway`: one OpenAI endpoint over many replicas (ones it starts, and/or --backend URLs).

    tokenmill gateway --replicas 2 --model smollm2-135m                      two local replicas, fixed
    tokenmill gateway --replicas 1 --model M --warm 1 --min 1 --max 4        warm buffer + autoscaling
    tokenmill gateway --backend http://10.0.0.5:8000 --backend http://10.0.0.6:8000 --policy prefix_affinity

Also registers `tokenmill deploy` (cli/deploy.py), so that cli/main.py needs one entry for both.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from tokenmill.cli.deploy import add_deploy_parser
from tokenmill.gateway.config import (
    AutoscaleConfig,
    BreakerConfig,
    GatewayConfig,
    HealthConfig,
    LocalReplicaConfig,
    RetryConfig,
)
from tokenmill.kernels import QUANTIZATIONS

POLICY_NAMES = ("prefix_affinity", "least_outstanding", "round_robin")  # policies.POLICIES, without its imports


def add_gateway_parsers(subparsers: Any) -> None:
    add_gateway_parser(subparsers)
    add_deploy_parser(subparsers)


def add_gateway_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("gateway", help="route one OpenAI endpoint over several replicas")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model", default=None, help="what local replicas serve (as for `tokenmill serve`)")
    parser.add_argument("--replicas", type=int, default=0, help="local replicas to start at once")
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="a replica someone else runs (repeatable), e.g. http://10.0.0.5:8000")
    parser.add_argument("--serve-args", default="", help="extra flags for local replicas, e.g. '--dtype float32'")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="local replicas' weights (as `tokenmill serve --quantization`)")
    parser.add_argument("--log-dir", default=None, help="write each local replica's output here")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="debug also logs every HTTP request the gateway sends, health probes included")
    _add_routing_arguments(parser)
    _add_scaling_arguments(parser)
    parser.set_defaults(handler=run_gateway_command)


def _add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="prefix_affinity", choices=POLICY_NAMES)
    parser.add_argument("--epsilon", type=float, default=0.25,
                        help="prefix affinity spills to the next replica above (1 + epsilon) x the mean load")
    parser.add_argument("--prefix-chars", type=int, default=256, help="prompt characters that name its prefix")
    parser.add_argument("--max-attempts", type=int, default=3, help="tries per request before it fails")
    parser.add_argument("--wait-for-replica", type=float, default=10.0,
                        help="seconds a request waits for some replica to be ready")
    parser.add_argument("--probe-interval", type=float, default=1.0, help="seconds between /ready probes")
    parser.add_argument("--eject-after", type=int, default=3, help="consecutive failures that eject a replica")
    parser.add_argument("--eject-for", type=float, default=5.0, help="seconds before an ejected replica's trial")


def _add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warm", type=int, default=None, help="idle warm local replicas kept beyond the load")
    parser.add_argument("--min", type=int, default=None, dest="min_replicas", help="fewest local replicas")
    parser.add_argument("--max", type=int, default=None, dest="max_replicas", help="most local replicas")
    parser.add_argument("--target-load", type=float, default=8.0,
                        help="outstanding requests per replica the autoscaler aims for")
    parser.add_argument("--scale-down-delay", type=float, default=30.0,
                        help="seconds of low load before a replica is drained")


def build_config(args: argparse.Namespace) -> GatewayConfig:
    local = None
    if args.model is not None:
        local = LocalReplicaConfig(args.model, tuple(shlex.split(args.serve_args)), log_dir=args.log_dir,
                                   quantization=args.quantization)
    autoscale = _autoscale_config(args)
    initial = max(args.replicas, autoscale.min_replicas if autoscale is not None else 0)
    return GatewayConfig(
        host=args.host, port=args.port, backends=tuple(args.backend), local=local, initial_replicas=initial,
        policy=args.policy, affinity_epsilon=args.epsilon, affinity_prefix_chars=args.prefix_chars,
        retry=RetryConfig(max_attempts=args.max_attempts, wait_for_replica_s=args.wait_for_replica),
        breaker=BreakerConfig(failure_threshold=args.eject_after, open_s=args.eject_for,
                              max_open_s=max(60.0, args.eject_for)),
        health=HealthConfig(probe_interval_s=args.probe_interval), autoscale=autoscale)


def _autoscale_config(args: argparse.Namespace) -> AutoscaleConfig | None:
    """None (a fixed fleet of --replicas) unless a scaling flag is given."""
    if args.warm is None and args.min_replicas is None and args.max_replicas is None:
        return None
    warm = args.warm or 0
    min_replicas = args.min_replicas if args.min_replicas is not None else args.replicas
    max_replicas = args.max_replicas if args.max_replicas is not None else max(min_replicas, args.replicas) + warm
    return AutoscaleConfig(min_replicas, max(1, max_replicas), warm, args.target_load,
                           scale_down_delay_s=args.scale_down_delay)


def run_gateway_command(args: argparse.Namespace) -> int:
    from tokenmill.gateway.app import run_gateway

    _configure_logging(args.log_level)
    return run_gateway(build_config(args), log_level=args.log_level)


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
