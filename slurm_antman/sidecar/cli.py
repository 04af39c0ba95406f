"""``antman sidecar --config antman.yaml [--node NAME] [--socket-dir DIR] [--telemetry MODE]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from slurm_antman import config as cfgmod
from slurm_antman.service import serve_until_stopped

from slurm_antman.policy.node.compliance import ComplianceParams
from .daemon import Sidecar, SidecarOptions
from .endpoints import SocketDirError
from slurm_antman.policy.node.core import MiB, NodePolicyParams, crawl_threshold
from .telemetry import TelemetryError, open_telemetry
from .uplink import uplink_options

log = logging.getLogger("antman.sidecar")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="antman sidecar", description="Run the slurm-antman node sidecar.")
    ap.add_argument("--config", required=True, help="antman.yaml")
    ap.add_argument("--node", help="Slurm node name this sidecar serves (default: this host's short name)")
    ap.add_argument("--socket-dir", help="directory for the control and job sockets (default: sidecar.socket_dir/NODE)")
    ap.add_argument("--telemetry", choices=("auto", "nvml", "emulated"),
                    help="GPU telemetry source (default: sidecar.telemetry)")
    ap.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                    help="least severity logged (to stderr: the journal under systemd)")
    return ap


def policy_params(conf: cfgmod.AntmanConfig, node: Optional[str] = None) -> NodePolicyParams:
    """Policy knobs from the config (``node``'s own where they are per node)."""
    sc = conf.sidecar
    return NodePolicyParams(
        pin_budget_bytes=conf.pin_budget_bytes(node) if node is not None else 0,
        headroom_bytes=sc.memory_headroom_mb * MiB,
        min_opportunistic_bytes=sc.min_opportunistic_memory_mb * MiB,
        target_slowdown=sc.target_slowdown,
        slow_preempt_s=sc.slow_preempt_s,
        pause_max_s=sc.pause_max_s,
        resume_hold_s=sc.resume_hold_s,
        elastic_hold_s=sc.elastic_hold_s,
        grace_s=float(conf.grace_time_s),
        min_progress=conf.opportunistic.min_progress,
        crawl_below=crawl_threshold(conf.opportunistic.min_progress, conf.opportunistic.move_gain),
    )


def build(conf: cfgmod.AntmanConfig, node: str, socket_dir: Optional[str] = None,
          telemetry: Optional[str] = None, tick_s: Optional[float] = None, uplink: bool = True) -> Sidecar:
    """A sidecar for ``node``; with ``uplink`` it reports to the coordinator when keys are configured."""
    groups = conf.node_groups_by_host()
    group = groups.get(node)
    if group is None:
        known = ", ".join(sorted(groups)[:20])
        raise cfgmod.ConfigError("antman.yaml", [("nodes", f"node {node!r} is not listed (known: {known}); "
                                                  "pass --node with a Slurm node name")])
    tele = open_telemetry(telemetry or conf.sidecar.telemetry, group.gpus, group.gpu_memory_mb * MiB)
    if tele.kind == "nvml" and tele.gpu_count() != group.gpus:
        log.warning("NVML finds %d GPU(s) on %s, antman.yaml says %d; using NVML's", tele.gpu_count(), node, group.gpus)
    opt = sidecar_options(conf, node, socket_dir or conf.node_socket_dir(node), tick_s,
                          uplink_options(conf, node) if uplink else None)
    return Sidecar(opt, tele)


def sidecar_options(conf: cfgmod.AntmanConfig, node: str, socket_dir: str, tick_s: Optional[float],
                    uplink) -> SidecarOptions:
    return SidecarOptions(
        node=node, socket_dir=socket_dir, heartbeat_s=conf.sidecar.heartbeat_s,
        grace_s=float(conf.grace_time_s), slots_per_gpu=conf.opportunistic.slots_per_gpu,
        utilization_threshold=conf.opportunistic.utilization_threshold,
        utilization_window_s=conf.opportunistic.utilization_window_s,
        tick_s=tick_s if tick_s is not None else min(1.0, conf.sidecar.heartbeat_s),
        params=policy_params(conf, node), uplink=uplink, enforce=conf.sidecar.enforce,
        no_room_wait=conf.sidecar.enforce and conf.opportunistic.no_room == "wait",
        hooks_state_dir=os.path.join(conf.state_dir, node),
        compliance=ComplianceParams(grace_s=conf.sidecar.compliance_grace_s),
        slot_filling=conf.sidecar.slot_filling, slot_fill=float(conf.sidecar.slot_fill_efficiency))


# What a reload cannot change in a running sidecar: sockets, telemetry and the uplink are bound.
_RESTART_ONLY = ("sidecar.socket_dir", "sidecar.telemetry", "sidecar.metrics_port", "sidecar.metrics_bind",
                 "sidecar.metrics_tls",
                 "coordinator.endpoint", "coordinator.key_dir", "coordinator.node_secret_key")


def _get(conf: cfgmod.AntmanConfig, dotted: str):
    obj = conf
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def make_reloader(path: str, node: str, conf: cfgmod.AntmanConfig):
    """SIGHUP: re-read antman.yaml; an invalid file or one without this node keeps the running options."""
    state = {"conf": conf}

    def reload(current: SidecarOptions) -> Optional[SidecarOptions]:
        log.info("SIGHUP: re-reading %s", path)
        try:
            new = cfgmod.load(path)
        except cfgmod.ConfigError as e:
            log.error("reload REJECTED, keeping the running configuration: %s", str(e).replace("\n", ";"))
            return None
        if node not in new.node_groups_by_host():
            log.error("reload REJECTED, keeping the running configuration: node %s is no longer in %s", node, path)
            return None
        for key in _RESTART_ONLY:
            if _get(new, key) != _get(state["conf"], key):
                log.warning("reload: %s changed; it takes effect at the next restart of the sidecar", key)
        state["conf"] = new
        return sidecar_options(new, node, current.socket_dir, None, current.uplink)

    return reload


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    node = args.node or os.uname().nodename.split(".")[0]
    try:
        conf = cfgmod.load(args.config)
        sidecar = build(conf, node, args.socket_dir, args.telemetry)
    except cfgmod.ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except TelemetryError as e:
        print(f"antman sidecar: telemetry: {e}", file=sys.stderr)
        return 1
    try:
        sidecar.start()
    except SocketDirError as e:
        sidecar.close()
        print(f"antman sidecar: {e}", file=sys.stderr)
        return 1
    metrics_server = None
    if conf.sidecar.metrics_port:
        from prometheus_client import CollectorRegistry

        from slurm_antman import metrics

        registry = CollectorRegistry()
        sidecar.metrics = metrics.SidecarCollector()
        registry.register(sidecar.metrics)
        try:
            metrics_server = metrics.serve(registry, conf.sidecar.metrics_bind, conf.sidecar.metrics_port,
                                           conf.sidecar.metrics_tls)
        except OSError as e:
            # Metrics are for watching; jobs must not lose their sidecar because a port is taken.
            log.error("metrics endpoint %s:%d not served: %s", conf.sidecar.metrics_bind, conf.sidecar.metrics_port, e)
    sidecar.reloader = make_reloader(args.config, node, conf)
    serve_until_stopped(sidecar, metrics_server)
    log.info("sidecar for node %s stopped", node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
