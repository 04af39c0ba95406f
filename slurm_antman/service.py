"""How the two daemons run as services: SIGTERM/SIGINT stop them, SIGHUP asks for a reload, and
their metrics endpoint closes with them. One place, so the sidecar and the coordinator behave alike
under systemd."""

from __future__ import annotations

import signal
from typing import Any, Optional


def serve_until_stopped(daemon: Any, metrics_server: Optional[Any] = None) -> None:
    """``daemon`` has ``stop()``, ``request_reload()`` and ``serve_forever()``."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    signal.signal(signal.SIGHUP, lambda *_: daemon.request_reload())
    try:
        daemon.serve_forever()
    finally:
        if metrics_server is not None:
            metrics_server.close()
