"""SlurmBackend over the Slurm commands (sbatch, squeue --json, scontrol, scancel, sinfo --json).

One code path for every supported Slurm; where a command differs by version, ``version.py`` says
which to run (the installed version is read once per backend)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

from .backend import Options, SlurmBackend
from .errors import (CommandFailed, JobNotFound, SlurmError, SlurmOutputError, SlurmUnavailable,
                     SubmissionRejected)
from .models import Association, Job, Node
from . import version as slurm_version
from .parsing import (ASSOC_FORMAT, associations_from_sacctmgr, filter_jobs, job_from_scontrol,
                      jobs_from_squeue_json, nodes_from_sinfo_json, parse_scontrol_config, sdiag_time)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0

# Messages Slurm's client library prints when the controller cannot be reached.
_UNAVAILABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|Zero Bytes were transmitted"
    r"|Communication connection failure|Slurm backup controller in standby mode|Unable to establish",
    re.IGNORECASE)
_NOT_FOUND = re.compile(r"Invalid job id specified", re.IGNORECASE)
_FIELD = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_SIGNAL = re.compile(r"^(SIG)?[A-Z0-9]{1,10}$|^\d{1,2}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


_RAW_ID = re.compile(r"^[1-9]\d{0,9}$")
_ARRAY_REF = re.compile(r"^[1-9]\d*_(\d+|\[\d+([-,]\d+)*\])$")


def _slurm_field(name: str) -> str:
    """``admin_comment`` -> ``AdminComment``; Slurm names (``TimeLimit``) pass through."""
    if not _FIELD.match(name):
        raise ValueError(f"update field {name!r} is not a Slurm job field name")
    return "".join(p[:1].upper() + p[1:] for p in name.split("_")) if "_" in name or name.islower() else name


def _update_args(fields: Mapping[str, Union[str, int]], target: str) -> list[str]:
    """``Name=value`` arguments of ``scontrol update``; ``target`` (JobId, NodeName) names what is updated."""
    if not fields:
        raise ValueError(f"update needs at least one field besides {target}")
    out = []
    for k, v in fields.items():
        name = _slurm_field(k)
        if name.lower() == target.lower():
            raise ValueError(f"{target} is what to update, not a field to change")
        text = str(v)
        if "\n" in text or "\r" in text:
            raise ValueError(f"update field {name}: value must be one line")
        out.append(f"{name}={text}")
    return out


def _sbatch_options(options: Options) -> list[str]:
    if isinstance(options, Mapping):
        out = []
        for k, v in options.items():
            flag = "--" + str(k).replace("_", "-").lstrip("-")
            if v is True:
                out.append(flag)
            elif v is not None and v is not False:
                out.append(f"{flag}={v}")
        return out
    opts = list(options)
    if isinstance(options, str) or any(not isinstance(o, str) for o in opts) or (opts and not opts[0].startswith("-")):
        raise ValueError(f"sbatch options {options!r} must be a list of strings starting with an option "
                         "(e.g. ['--gres=gpu:2', '-p', 'gpu']) or a mapping {'gres': 'gpu:2'}")
    return opts


def _parse(argv: list[str], r: subprocess.CompletedProcess, parse: Callable[[], T]) -> T:
    try:
        return parse()
    except SlurmOutputError as e:
        if e.command:
            raise
        raise SlurmOutputError(e.message, argv, r.stderr) from None


class CliBackend(SlurmBackend):
    """Runs the Slurm client commands with a timeout each.

    ``env`` is the environment for every command (e.g. one with ``SLURM_CONF`` of a dev cluster);
    ``gres_name`` is the GRES of physical GPUs (antman.yaml ``slurm.gpu_gres``).
    """

    def __init__(self, env: Optional[Mapping[str, str]] = None, timeout: float = DEFAULT_TIMEOUT_S,
                 gres_name: str = "gpu"):
        self.env = dict(env) if env is not None else None
        self.timeout = timeout
        self.gres_name = gres_name
        self._version: Optional[slurm_version.Version] = None

    def version(self) -> "slurm_version.Version":
        """The installed Slurm's version; UnsupportedSlurm (one line) outside the supported range."""
        if self._version is None:
            self._check_conf(["slurmctld", "-V"])
            self._version = slurm_version.check_supported(
                slurm_version.installed_version(self.env, timeout=self.timeout))
        return self._version

    # -- running commands ------------------------------------------------------------------
    def _run(self, argv: list[str], job_id: Optional[int | str] = None, input: Optional[str] = None,
             env: Optional[Mapping[str, str]] = None, check: bool = True) -> subprocess.CompletedProcess:
        """``check=False``: a non-zero exit is the caller's to read (JSON output carries its own errors)."""
        run_env = dict(self.env if self.env is not None else os.environ)
        if env:
            run_env.update(env)
        exe = shutil.which(argv[0], path=run_env.get("PATH"))
        if exe is None:
            raise SlurmUnavailable(f"{argv[0]} not found on PATH: are the Slurm client commands installed?", argv)
        self._check_conf(argv, run_env)
        try:
            r = subprocess.run([exe, *argv[1:]], env=run_env, input=input, capture_output=True, text=True,
                               timeout=self.timeout, stdin=None if input is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise SlurmUnavailable(f"{argv[0]} did not finish within {self.timeout:g} s "
                                   "(is slurmctld running and reachable?)", argv, err) from None
        # scancel exits 0 on an unknown job id and only says so on stderr with --verbose.
        if check and (r.returncode != 0 or (argv[0] == "scancel" and "error:" in r.stderr)):
            self._raise(argv, r, job_id)
        return r

    def _check_conf(self, argv: list[str], run_env: Optional[Mapping[str, str]] = None) -> None:
        """Slurm's commands retry a missing slurm.conf once a second for 60 s before they give up (22.05:
        "retrying in 1sec up to 60sec"): a hook or daemon would stall on every call, so say it at once."""
        conf = (run_env if run_env is not None else (self.env if self.env is not None else os.environ)).get("SLURM_CONF")
        if conf and not os.path.exists(conf):
            raise SlurmUnavailable(f"SLURM_CONF names {conf}, which does not exist", argv)

    @staticmethod
    def _raise(argv: list[str], r: subprocess.CompletedProcess, job_id: Optional[int | str]) -> None:
        err = r.stderr.strip() or r.stdout.strip()
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(f"{argv[0]}: Terminating")]
        message = "; ".join(lines) or f"{argv[0]} exited with status {r.returncode}"
        if _UNAVAILABLE.search(err):
            raise SlurmUnavailable(f"Slurm controller unavailable: {message}", argv, err, r.returncode)
        if job_id is not None and _NOT_FOUND.search(err):
            raise JobNotFound(job_id, argv, message, r.returncode)
        if argv[0] == "sbatch":
            raise SubmissionRejected(f"submission rejected: {message}", argv, err, r.returncode)
        raise CommandFailed(f"{argv[0]} failed: {message}", argv, err, r.returncode)

    def _parsed(self, argv: list[str], parse: Callable[[str], T], job_id: Optional[int | str] = None) -> T:
        """Run ``argv`` and parse what it printed; a parse failure names the command and its stderr."""
        r = self._run(argv, job_id=job_id)
        return _parse(argv, r, lambda: parse(r.stdout))

    def _parsed_json(self, argv: list[str], parse: Callable[[Any], T]) -> T:
        """As ``_parsed`` for ``--json`` output, which carries the errors of a controller that is down."""
        r = self._run(argv)
        doc = self._checked_json(argv, r)
        return _parse(argv, r, lambda: parse(doc))

    def _checked_json(self, argv: list[str], r: subprocess.CompletedProcess) -> Any:
        """What ``argv`` printed, as JSON; its ``errors`` raised as the typed errors they name."""
        try:
            doc = json.loads(r.stdout)
        except json.JSONDecodeError as e:
            raise SlurmOutputError(f"{' '.join(argv)} printed invalid JSON ({e})", argv, r.stderr) from None
        if isinstance(doc, dict) and doc.get("errors"):
            self._json_errors(argv, doc["errors"])
        return doc

    def accounting_history(self, since: str, until: str = "now") -> str:
        """Every allocation accounting holds between ``since`` and ``until`` (sacct's -S/-E forms:
        ``2026-10-01``, ``now-30days``), all users, as ``sacct --json`` prints it: the text, checked to be
        JSON without errors, for a replay to read (lab/evaluation/sacct_trace.py)."""
        argv = ["sacct", "-X", "--allusers", "--json", "-S", since, "-E", until]
        r = self._run(argv)
        self._checked_json(argv, r)
        return r.stdout

    def _accounting(self, job: Union[int, str], field: str) -> Optional[list[str]]:
        """``field`` of ``job`` from accounting (``sacct``), one value a line; None without accounting storage."""
        argv = ["sacct", "-n", "-X", "-P", "-j", self._job_arg(job), "-o", field]
        try:
            r = self._run(argv)
        except CommandFailed:
            return None  # no accounting storage: slurmctld's word is all there is
        return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]

    @staticmethod
    def _job_arg(job_id: Union[int, str]) -> str:
        """A raw job id, or an array task's ``A_T`` / pending rest ``A_[2-5]`` (``Job.slurm_id``): the
        form that acts on that job alone."""
        if isinstance(job_id, str) and (_ARRAY_REF.match(job_id) or _RAW_ID.match(job_id)):
            return job_id
        if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
            raise ValueError(f"job id must be a positive integer or ARRAY_TASK, not {job_id!r}")
        return str(job_id)

    def _job_json(self, argv: list[str], job_id: int | str) -> list[Job]:
        """``scontrol show job --json ID``'s jobs; a job slurmctld does not know is JobNotFound, as from the
        text form (its error entry says "Invalid job id specified", and scontrol may exit non-zero)."""
        r = self._run(argv, job_id=job_id, check=False)
        try:
            doc = json.loads(r.stdout or "{}")
        except json.JSONDecodeError as e:
            raise SlurmOutputError(f"{' '.join(argv)} printed invalid JSON ({e})", argv, r.stderr) from None
        errors = doc.get("errors") if isinstance(doc, dict) else None
        text = " ".join(str(e.get("description", "")) + " " + str(e.get("error", ""))
                        for e in errors or [] if isinstance(e, dict))
        if _NOT_FOUND.search(text) or _NOT_FOUND.search(r.stderr or ""):
            raise JobNotFound(job_id, argv, text.strip() or r.stderr.strip(), r.returncode)
        if r.returncode != 0:
            self._raise(argv, r, job_id)
        if errors:
            self._json_errors(argv, errors)
        jobs = _parse(argv, r, lambda: jobs_from_squeue_json(doc, self.gres_name))
        if not jobs:
            # 25.11 answers an unknown id with an empty list and no error: say it as Slurm's text form does.
            raise JobNotFound(job_id, argv, "Invalid job id specified (scontrol show job --json lists no such job)",
                              r.returncode)
        return jobs

    def _json_errors(self, argv: list[str], errors: list) -> None:
        """squeue/sinfo --json exit 0 with only "Unspecified error" when the controller is down; ask
        ``scontrol ping`` so the error says what is wrong."""
        text = "; ".join(f"{e.get('source', '?')}: {e.get('description', '')} ({e.get('error', '')})"
                         if isinstance(e, dict) else str(e) for e in errors)
        try:
            ping = self._run(["scontrol", "ping"]).stdout.strip()
        except SlurmError as e:
            ping = e.stderr or e.message
        if "DOWN" in ping or "UP" not in ping:
            raise SlurmUnavailable(f"Slurm controller unavailable: {ping or 'scontrol ping failed'} "
                                   f"({argv[0]} reported: {text})", argv, text)
        raise CommandFailed(f"{argv[0]} --json reported errors: {text}", argv, text)

    # -- SlurmBackend ----------------------------------------------------------------------
    def submit(self, script: Union[str, Path, None] = None, *, wrap: Optional[str] = None,
               script_text: Optional[str] = None, options: Options = (),
               env: Optional[Mapping[str, str]] = None) -> int:
        given = [x is not None for x in (script, wrap, script_text)]
        if sum(given) != 1:
            raise ValueError("submit needs exactly one of script (a file), wrap (a command) or script_text")
        argv = ["sbatch", "--parsable", *_sbatch_options(options)]
        if wrap is not None:
            argv.append(f"--wrap={wrap}")
        elif script is not None:
            argv.append(str(script))
        r = self._run(argv, input=script_text, env=env)
        first = r.stdout.strip().splitlines()[-1:] or [""]
        job_id = first[0].split(";")[0]  # --parsable prints "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmOutputError(f"sbatch --parsable printed {r.stdout.strip()!r}, not a job id", argv, r.stderr)
        return int(job_id)

    def jobs(self, states: Optional[Iterable[str]] = None, users: Optional[Iterable[str]] = None) -> list[Job]:
        jobs = self._parsed_json(["squeue", "--json"], lambda doc: jobs_from_squeue_json(doc, self.gres_name))
        return filter_jobs(jobs, states, users) if states is not None or users is not None else jobs

    def job(self, job_id: int | str) -> Job:
        if slurm_version.job_show_json(self.version()):
            argv = ["scontrol", "show", "job", "--json", self._job_arg(job_id)]
            jobs = self._job_json(argv, job_id)
        else:
            argv = ["scontrol", "show", "job", "-o", "-d", self._job_arg(job_id)]
            jobs = self._parsed(argv, lambda out: [job_from_scontrol(ln, self.gres_name)
                                                   for ln in out.splitlines() if ln.strip()], job_id=job_id)
        if not jobs:
            raise JobNotFound(job_id, argv, "scontrol printed nothing")
        # An array's own id prints one line per task: the one asked for is the raw id's, or the task's.
        want = self._job_arg(job_id)
        for job in jobs:
            if str(job.job_id) == want or job.slurm_id == want:
                return job
        if len(jobs) == 1:
            return jobs[0]
        raise JobNotFound(job_id, argv, f"none of the {len(jobs)} records printed is job {want}")

    def resolve(self, job: Union[int, str]) -> Optional[int]:
        """The raw job id of ``job`` (a raw id or ``ARRAY_TASK``) if slurmctld or, for a job it has
        forgotten, accounting knows it; None when neither does. Raises SlurmUnavailable when the
        controller cannot be asked."""
        try:
            return self.job(job).job_id
        except JobNotFound:
            pass
        raw = [v for v in self._accounting(job, "JobIDRaw") or [] if v.isdigit()]
        return int(raw[0]) if raw else None

    def job_user(self, job_id: int) -> Optional[str]:
        """Whose job ``job_id`` is: slurmctld's word while it remembers the job, then accounting's;
        None when neither knows it. Raises SlurmUnavailable when the controller cannot be asked."""
        try:
            return self.job(job_id).user or None
        except JobNotFound:
            pass
        users = self._accounting(job_id, "User")
        return users[0] if users else None

    def requeue(self, job_id: int | str, hold: bool = False) -> None:
        self._run(["scontrol", "requeuehold" if hold else "requeue", self._job_arg(job_id)], job_id=job_id)

    def hold(self, job_id: int) -> None:
        self._run(["scontrol", "hold", self._job_arg(job_id)], job_id=job_id)

    def release(self, job_id: int) -> None:
        self._run(["scontrol", "release", self._job_arg(job_id)], job_id=job_id)

    def update(self, job_id: int | str, **fields: Union[str, int]) -> None:
        argv = ["scontrol", "update", f"JobId={self._job_arg(job_id)}", *_update_args(fields, "JobId")]
        self._run(argv, job_id=job_id)

    def update_node(self, node: str, **fields: Union[str, int]) -> None:
        if not _NODE_NAME.match(node):
            raise ValueError(f"{node!r} is not a Slurm node name")
        self._run(["scontrol", "update", f"NodeName={node}", *_update_args(fields, "NodeName")])

    def cancel(self, job_id: int, signal: Optional[str] = None) -> None:
        argv = ["scancel", "--verbose"]
        if signal is not None:
            if not _SIGNAL.match(str(signal)):
                raise ValueError(f"signal {signal!r} is not a signal name or number (e.g. USR1, SIGTERM, 10)")
            argv += [f"--signal={signal}", "--full"]
        argv.append(self._job_arg(job_id))
        self._run(argv, job_id=job_id)

    def signal(self, job_id: int | str, signal: str, batch_only: bool = False) -> None:
        # Without --verbose, as the coordinator has always sent it: a job that ended meanwhile is not an error.
        if not _SIGNAL.match(str(signal)):
            raise ValueError(f"signal {signal!r} is not a signal name or number (e.g. USR1, SIGTERM, 10)")
        argv = ["scancel", f"--signal={signal}", "--batch" if batch_only else "--full", self._job_arg(job_id)]
        self._run(argv, job_id=job_id)

    def batch_script(self, job_id: int | str) -> str:
        return self._run(["scontrol", "write", "batch_script", self._job_arg(job_id), "-"], job_id=job_id).stdout

    def nodes(self) -> list[Node]:
        return self._parsed_json(slurm_version.nodes_argv(self.version()), nodes_from_sinfo_json)

    def config(self) -> dict[str, str]:
        """``scontrol show config`` as key -> value (what slurmctld runs with, not what a file says)."""
        return self._parsed(["scontrol", "show", "config"], parse_scontrol_config)

    def sbatch_help(self) -> str:
        """What ``sbatch --help`` prints here: the options this host's sbatch (and its SPANK plugins) take."""
        return self._run(["sbatch", "--help"]).stdout

    def controller_time(self) -> float:
        """slurmctld's own clock as a Unix time: ``sdiag`` prints the time it answered at."""
        return self._parsed(["sdiag"], sdiag_time)

    def associations(self, cluster: Optional[str] = None) -> list[Association]:
        """Slurm accounting's associations (``sacctmgr``; needs slurmdbd), of ``cluster`` if given."""
        argv = ["sacctmgr", "-n", "-P", "show", "associations", f"format={','.join(ASSOC_FORMAT)}"]
        if cluster:
            argv.append(f"cluster={cluster}")
        return self._parsed(argv, associations_from_sacctmgr)


def default_backend(env: Optional[Mapping[str, str]] = None, gres_name: str = "gpu",
                    timeout: float = DEFAULT_TIMEOUT_S) -> SlurmBackend:
    """The backend of short-lived processes (hooks, commands): the CLI. The coordinator, which reads every
    job each cycle, chooses with ``pyslurm_backend.long_lived_backend``."""
    return CliBackend(env=env, timeout=timeout, gres_name=gres_name)


__all__ = ["CliBackend", "default_backend", "SlurmError"]
