"""The ``antman`` command. Subcommands import their modules lazily so ``antman node prolog`` (run by
slurmd for every job) does not pay for rich, torch or anything it does not use."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from slurm_antman.lab.devcluster.dirs import DEFAULT_DIR as DEVCLUSTER_DIR
from .errors import AntmanError


def _default_config() -> str:
    return os.environ.get("ANTMAN_CONFIG", "/etc/slurm-antman/antman.yaml")


def _cmd_devcluster(a: argparse.Namespace) -> int:
    from slurm_antman.lab.devcluster import cluster as dc

    d = Path(a.dir)
    if a.action == "up":
        # Only what was asked for on the line must match a cluster already running in the directory
        # (the demo's, left with --keep): `up` alone takes the running one as it is.
        given = {"nodes": a.nodes, "gpus": a.gpus, "cpus": a.cpus, "port_base": a.port_base,
                 "plain": a.plain or None, "accounting": False if a.no_accounting else None,
                 "hosts": a.hosts or None, "cgroups": False if a.no_cgroups else None, "switches": a.switches}
        given = {k: v for k, v in given.items() if v is not None}  # the rest: up()'s defaults
        already = dc.running(d)
        cluster = dc.up(d, **given, require=set(given))
        sys.stdout.write(dc.export_lines(cluster))
        state = "already running (left as it is)" if already is not None else "up"
        print(f"# devcluster {state} in {cluster.dir}: nodes {','.join(cluster.nodes)}, {cluster.gpus} GPUs each; "
              f"submit as its ordinary user: runuser -u {cluster.user} -- sbatch ...", file=sys.stderr)
        if cluster.hosts is not None:
            print(f"# the nodes are hosts of their own: Slurm answers on the controller's host, "
                  f"{cluster.hosts.addr('ctl')}; a shell there: {' '.join(cluster.hosts.enter('ctl'))} bash",
                  file=sys.stderr)
    elif a.action == "down":
        stopped = dc.down(d)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing (no cluster recorded in %s)" % d))
    else:
        st = dc.status(d)
        if a.json:
            print(json.dumps(st, indent=2))
        else:
            print(f"devcluster in {st['dir']}: {'running' if st['running'] else 'not running'}")
            for p in st["procs"]:
                print(f"  {p['name']:<16} pid {p['pid']:<8} {'alive' if p['alive'] else 'DEAD'}")
            for line in st.get("nodes", []):
                print(f"  {line}")
        return 0 if st["running"] else 3
    return 0


def _cmd_config(a: argparse.Namespace) -> int:
    from . import config as cm
    from slurm_antman.admin.render import RenderOptions, write_all
    from slurm_antman.slurm import version as slurm_version

    try:
        cfg = cm.load(a.file)
    except cm.ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.action == "merge-slurm-conf":
        from slurm_antman.admin import site_settings

        return site_settings.merge_command(cfg, a.slurm_conf, a.hook_dir, a.dry_run)
    if a.action == "check":
        hosts = sum(len(g.hosts) for g in cfg.nodes)
        gpus = sum(len(g.hosts) * g.gpus for g in cfg.nodes)
        print(f"{a.file}: OK ({hosts} nodes, {gpus} GPUs, {len(cfg.tenants)} tenants, "
              f"default class {cfg.default_class.value})")
        return 0
    out = Path(a.out)
    opts = RenderOptions(config_path=a.config_path or str(Path(a.file).resolve()),
                         hook_dir=a.hook_dir or str(out.resolve()), slurm_conf=a.slurm_conf,
                         slurm_bin=slurm_version.commands_dir())
    for path in write_all(cfg, out, opts):
        print(path)
    return 0


def _cmd_node(a: argparse.Namespace) -> int:
    from . import prolog_epilog

    return prolog_epilog.main(a.hook, a.config)


def _cmd_squeue(a: argparse.Namespace) -> int:
    from .views import squeue as squeue_view

    return squeue_view.main(a)


def _cmd_nodes(a: argparse.Namespace) -> int:
    from .views import nodes as nodes_view

    return nodes_view.main(a)


def _cmd_demo(a: argparse.Namespace) -> int:
    from .lab import demo

    return demo.main(a)


_BENCHES = {"submit": "lab.bench.submit", "control": "lab.bench.control", "coordinator": "lab.bench.coordinator",
            "simulate": "lab.bench.simulate", "trace": "lab.bench.trace", "models": "lab.bench.models",
            "gpu": "lab.bench.gpu", "faults": "lab.bench.faults", "pause": "lab.bench.pause",
            "elastic": "lab.bench.elastic", "interleave": "lab.bench.interleave",
            "slurm-backend": "lab.bench.slurm_backend", "trade": "lab.bench.trade", "pin": "lab.bench.pin"}


def _cmd_bench(a: argparse.Namespace, rest: list[str]) -> int:
    module = _BENCHES.get(a.what)
    if module is not None:
        import importlib

        return importlib.import_module(f".{module}", __package__).main(rest)
    print(f"antman bench: unknown benchmark {a.what!r}; allowed: {', '.join(_BENCHES)}",
          file=sys.stderr)
    return 2


def _cmd_explain(a: argparse.Namespace) -> int:
    from .coordinator import explain

    return explain.run(a)


# Daemons and tools with their own argument parsers: `antman NAME ARGS...` hands ARGS over untouched.
_PASSTHROUGH = {
    "sidecar": ("slurm_antman.sidecar.cli", "the per-node daemon"),
    "coordinator": ("slurm_antman.coordinator.daemon", "the cluster coordinator (beside slurmctld)"),
    "keys": ("slurm_antman.curve_keys", "CURVE keys for the sidecar-coordinator link"),
    "doctor": ("slurm_antman.admin.doctor", "check a node or the controller and name what is missing or wrong"),
    "agent-bundle": ("slurm_antman.admin.agent_bundle", "build the directory a job's own Python loads the agent from"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="antman", description="AntMan-style dynamic GPU sharing for Slurm")
    sub = p.add_subparsers(dest="cmd", required=True)

    dc = sub.add_parser("devcluster", help="a real local Slurm cluster on loopback")
    dc.add_argument("action", choices=["up", "down", "status"],
                    help="up: start a cluster in --dir (or report the one running there); down: stop it; "
                         "status: its daemons and nodes")
    dc.add_argument("--dir", default=str(DEVCLUSTER_DIR),
                    help="the cluster's directory: configuration, state, logs; the demo's too (default: "
                         "$ANTMAN_DEVCLUSTER_DIR or /tmp/antman-devcluster)")
    # No defaults here: `up` tells a flag given (which a running cluster must match) from one left out.
    dc.add_argument("--nodes", type=int, help="slurmd nodes, node1 to nodeN (default 2)")
    dc.add_argument("--gpus", type=int, help="fake GPUs per node (default 4)")
    dc.add_argument("--cpus", type=int, help="CPUs each node claims (default 4)")
    dc.add_argument("--port-base", type=int, help="slurmctld port; slurmd ports follow (default 17817)")
    dc.add_argument("--plain", action="store_true", help="plain Slurm, without the slurm-antman stack")
    dc.add_argument("--no-accounting", action="store_true",
                    help="no slurmdbd and MariaDB (sacct then fails; quotas come from antman.yaml)")
    dc.add_argument("--hosts", action="store_true",
                    help="every node a host of its own: a network namespace and address per node, the controller "
                         "and coordinator in another")
    dc.add_argument("--no-cgroups", action="store_true",
                    help="no device cgroups (TaskPlugin=task/none): every job can open every emulated GPU")
    dc.add_argument("--switches", type=int,
                    help="emulated leaf switches over the nodes, each over a run of consecutive nodes (topology.conf, "
                         "TopologyPlugin=topology/tree); default 0: no topology")
    dc.add_argument("--json", action="store_true", help="status: print it as JSON")
    dc.set_defaults(func=_cmd_devcluster)

    cf = sub.add_parser("config", help="validate antman.yaml or render the Slurm files from it")
    cf.add_argument("action", choices=["check", "render", "merge-slurm-conf"],
                    help="check: validate FILE; render: write the Slurm files made from it to --out; "
                         "merge-slurm-conf: merge the site-wide settings slurm-antman needs into --slurm-conf "
                         "(appended to the site's lists, the original backed up; nothing written on a conflict)")
    cf.add_argument("file", help="the antman.yaml to read")
    cf.add_argument("--out", default="antman-rendered", help="render: output directory")
    cf.add_argument("--config-path", help="render: where antman.yaml will live on the nodes")
    cf.add_argument("--hook-dir", help="render: where antman-prolog/epilog will live (default --out); "
                                       "merge-slurm-conf: the same directory, for Prolog= and Epilog=")
    cf.add_argument("--slurm-conf", help="render: slurm.conf the hooks use, when not in Slurm's default place; "
                                         "merge-slurm-conf: the slurm.conf to merge into (default: $SLURM_CONF or "
                                         "/etc/slurm/slurm.conf)")
    cf.add_argument("--dry-run", action="store_true", help="merge-slurm-conf: print the changes, write nothing")
    cf.set_defaults(func=_cmd_config)

    nd = sub.add_parser("node", help="Slurm Prolog/Epilog hooks (run by slurmd)")
    nd.add_argument("hook", choices=["prolog", "epilog"],
                    help="which hook slurmd runs: prolog (before the job starts) or epilog (after it ends)")
    nd.add_argument("--config", default=_default_config(),
                    help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    nd.set_defaults(func=_cmd_node)

    sq = sub.add_parser("squeue", help="jobs with their slurm-antman class and GPUs")
    sq.add_argument("--json", action="store_true", help="print the jobs as JSON")
    sq.add_argument("--all", action="store_true", help="include finished jobs Slurm still remembers")
    sq.add_argument("-j", "--jobs", type=_job_ids, default=None, metavar="IDS",
                    help="only these jobs: JOBID, ARRAYID_TASKID or ARRAYID (every task), comma separated")
    sq.add_argument("--config", help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    sq.set_defaults(func=_cmd_squeue)

    no = sub.add_parser("nodes", help="nodes and GPUs: Slurm state, GRES, sidecar telemetry and jobs")
    no.add_argument("--json", action="store_true", help="print the nodes and GPUs as JSON")
    no.add_argument("--config", help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    no.set_defaults(func=_cmd_nodes)

    de = sub.add_parser("demo", help="the guided demo on a local cluster")
    de.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    de.add_argument("--dir", default=str(DEVCLUSTER_DIR),
                    help="the cluster's directory, as `antman devcluster --dir`: the cluster --keep leaves is the "
                         "one `antman devcluster up/status/down` find there (default: $ANTMAN_DEVCLUSTER_DIR or "
                         "/tmp/antman-devcluster)")
    de.add_argument("--port-base", type=int, default=17917, help="slurmctld port; slurmd ports follow")
    de.set_defaults(func=_cmd_demo)

    be = sub.add_parser("bench", help="benchmarks (results go to docs/benchmarks.md)", add_help=False)
    be.add_argument("what", help=f"the benchmark: {', '.join(_BENCHES)} (each has its own --help)")
    be.set_defaults(func=None)

    ex = sub.add_parser("explain", help="why the coordinator did what it did to a job (audit log)")
    from .coordinator import explain

    explain.add_arguments(ex)
    ex.set_defaults(func=_cmd_explain)

    for name, (_, text) in _PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def _job_ids(text: str) -> list[str]:
    from .views.squeue import parse_job_ids

    try:
        return parse_job_ids(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _permission_hint(cmd: str) -> str:
    return {
        "explain": "the audit log is the coordinator's; an admin can read it (or pass --audit-log FILE)",
    }.get(cmd, "this needs an admin's rights (run it as root or the slurm-antman service user)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands with their own parsers get the rest of the line untouched.
    if argv[:1] and argv[0] in _PASSTHROUGH:
        import importlib

        return importlib.import_module(_PASSTHROUGH[argv[0]][0]).main(argv[1:])
    if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):
        return _cmd_bench(argparse.Namespace(what=argv[1]), argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `antman squeue | head`: the reader has all it wanted. Point stdout at /dev/null so that the
        # interpreter's own flush at exit does not fail on the closed pipe once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except AntmanError as e:  # an expected failure: one clear line, not a traceback
        if os.environ.get("ANTMAN_DEBUG") == "1":
            raise
        print(f"antman {args.cmd}: {e}", file=sys.stderr)
        return 1
    except PermissionError as e:
        if os.environ.get("ANTMAN_DEBUG") == "1":
            raise
        print(f"antman {args.cmd}: permission denied: {e.filename or e}: {_permission_hint(args.cmd)}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
