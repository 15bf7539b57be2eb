"""`tokenmill serve` flags for service classes (docs/workload_classes.md): SLO targets per class, a
default class per API key, the interactive share of the queue, and the switch that turns the
SLO-aware scheduling off.

    --protected-slowdown 0.05              how much batch work may slow an interactive step, by the fit

    --slo interactive:ttft=0.5,tpot=0.08   seconds; `none` clears a target; classes not named keep theirs
    --api-key-class KEY=batch              requests with bearer KEY default to the batch class
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenmill.engine.service_class import ServiceClass, parse_service_tier
from tokenmill.errors import TokenmillError

# The config module imports torch: only when `serve` runs, not whenever a parser is built.
if TYPE_CHECKING:
    from tokenmill.config import ServiceClassConfig, SLOTarget

_SLO_KEYS = ("ttft", "tpot")


def add_service_class_arguments(parser: Any) -> None:
    group = parser.add_argument_group("service classes (interactive, standard, batch)")
    group.add_argument("--slo", action="append", default=[], metavar="CLASS:ttft=S,tpot=S",
                       help="a class's latency targets in seconds (none: no target); repeatable. Defaults: "
                            "interactive ttft=1,tpot=0.1; standard ttft=5,tpot=0.5; batch none")
    group.add_argument("--api-key-class", action="append", default=[], metavar="KEY=CLASS",
                       help="requests with this bearer key default to CLASS (the key is accepted like --api-key); "
                            "a body service_tier or the x-tokenmill-service-tier header still overrides it")
    group.add_argument("--batch-stream-interval", type=float, default=0.25, metavar="SECONDS",
                       help="streamed batch-class responses get a chunk at most this often (0: every step)")
    group.add_argument("--interactive-queue-reserve", type=float, default=0.25, metavar="FRACTION",
                       help="share of --max-queue-requests/--max-queue-tokens only interactive requests may fill")
    group.add_argument("--calibration-steps", type=int, default=24, metavar="N",
                       help="synthetic steps that fit the step-time model while the new server idles, stopped by "
                            "the first request (0: learn from live traffic only)")
    group.add_argument("--protected-slowdown", default=None, metavar="FRACTION",
                       help="lower classes fill a step holding interactive work only while it stays within this "
                            "fraction over that work's own predicted time ('none': the TPOT target alone bounds "
                            "them; default: ServiceClassConfig's, docs/workload_classes.md)")
    group.add_argument("--no-slo-scheduling", action="store_true",
                       help="schedule without regard to classes (they still label metrics and logs)")


def service_class_config(args: argparse.Namespace) -> ServiceClassConfig:
    from tokenmill.config import ServiceClassConfig

    targets = {c: ServiceClassConfig().target(c) for c in ServiceClass}
    for item in args.slo:
        service_class, spec = _split_slo(item)
        targets[service_class] = _parse_targets(item, spec, targets[service_class])
    if args.calibration_steps < 0:
        raise TokenmillError(f"--calibration-steps must be >= 0, got {args.calibration_steps}")
    config = ServiceClassConfig(enabled=not args.no_slo_scheduling, interactive=targets[ServiceClass.INTERACTIVE],
                                standard=targets[ServiceClass.STANDARD], batch=targets[ServiceClass.BATCH],
                                calibration_steps=args.calibration_steps)
    if args.protected_slowdown is not None:
        config = replace(config, protected_slowdown=_slowdown(args.protected_slowdown))
    return config


def _slowdown(value: str) -> float | None:
    return _number_or_none(value, lambda x: x >= 0, f"--protected-slowdown takes a fraction or 'none', got {value!r}",
                           f"--protected-slowdown must be >= 0, got {value!r}")


def _number_or_none(value: str, valid: Callable[[float], bool], not_a_number: str, out_of_range: str) -> float | None:
    """A flag's number, or None for 'none'; the messages are its one-line errors."""
    if value.lower() == "none":
        return None
    try:
        number = float(value)
    except ValueError:
        raise TokenmillError(not_a_number) from None
    if not valid(number):
        raise TokenmillError(out_of_range)
    return number


def _split_slo(item: str) -> tuple[ServiceClass, str]:
    name, sep, spec = item.partition(":")
    if not sep or not spec:
        raise TokenmillError(f"--slo takes CLASS:ttft=SECONDS,tpot=SECONDS, got {item!r}")
    return parse_service_tier(name), spec


def _parse_targets(item: str, spec: str, target: SLOTarget) -> SLOTarget:
    for part in spec.split(","):
        key, eq, value = part.partition("=")
        if key not in _SLO_KEYS or not eq:
            raise TokenmillError(f"--slo {item!r}: each target is ttft=SECONDS or tpot=SECONDS (or =none)")
        seconds = _seconds(value, item)
        target = replace(target, ttft_s=seconds) if key == "ttft" else replace(target, tpot_s=seconds)
    return target


def _seconds(value: str, item: str) -> float | None:
    return _number_or_none(value, lambda x: x > 0, f"--slo {item!r}: {value!r} is not a number of seconds",
                           f"--slo {item!r}: a target must be positive seconds (or none)")


def api_key_classes(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in args.api_key_class:
        key, sep, name = item.rpartition("=")
        if not sep or not key:
            raise TokenmillError(f"--api-key-class takes KEY=CLASS, got {item!r}")
        pairs.append((key, parse_service_tier(name).value))
    return tuple(pairs)
