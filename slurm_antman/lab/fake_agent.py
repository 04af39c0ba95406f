"""An agent without a training process: a DEALER in the calling process speaking the agent side of
docs/protocol.md to a real sidecar, so a benchmark or a test decides exactly what the sidecar is
told (a guaranteed job's memory burst, one report to scrape) without torch or a job."""

from __future__ import annotations

import os

import zmq

from slurm_antman import protocol as p


class FakeAgent:
    def __init__(self, endpoint: str, job_id: str, job_class: str = "opportunistic", hostname: str = "fake",
                 agent_version: str = "fake"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.job_id = job_id
        self.job_class = job_class
        self.hostname = hostname
        self.agent_version = agent_version
        self.iteration = 0

    def send(self, body: p.Body) -> None:
        self.sock.send_multipart(p.encode(p.message(body)))

    def register(self, wait_s: float = 5.0) -> None:
        """Register as rank 0 of one; ``wait_s`` 0 sends without waiting for ``registered`` (the
        next :meth:`report_memory` drains it)."""
        self.send(p.Register(job_id=self.job_id, pid=os.getpid(), rank=0, local_rank=0, world_size=1,
                             hostname=self.hostname, agent_version=self.agent_version, torch_version="none",
                             device="cuda", job_class=self.job_class))
        if wait_s > 0:
            if not self.sock.poll(int(wait_s * 1000)):
                raise RuntimeError(f"job {self.job_id}: no reply to register in {wait_s:g} s")
            got = p.decode(self.sock.recv_multipart(), p.SIDECAR_TO_AGENT)
            if got.type != "registered":
                raise RuntimeError(f"job {self.job_id}: register answered with {got.type}: {got.body}")

    def report_memory(self, mem: int) -> None:
        """One iteration's report that says ``mem`` bytes are in use, then whatever the sidecar sent
        read and dropped: a caller that only reports never lets replies queue up."""
        self.iteration += 1
        self.send(p.Report(iteration=self.iteration, iterations=1, iteration_ms=100.0, busy_ms=10.0,
                           mem_allocated_bytes=mem, mem_reserved_bytes=mem, mem_peak_bytes=mem, spilled_bytes=0,
                           limits_seq=0))
        while self.sock.poll(0):
            self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
