"""metrics_tls: the metrics endpoint (every job's account, memory, mini-batch time) over HTTPS with
client certificates, so only the site's Prometheus reads it. Certificates made with openssl here."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from slurm_antman import config, metrics

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and two client certificates: one from the CA, one not."""
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=antman-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "prometheus"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "stranger.key", "-out", "stranger.pem",
             "-days", "1", "-subj", "/CN=stranger", cwd=d)
    return d


def _get(url: str, pki, client: str | None) -> str:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client:
        ctx.load_cert_chain(str(pki / f"{client}.pem"), str(pki / f"{client}.key"))
    with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
        return r.read().decode()


def test_only_a_client_with_the_sites_certificate_reads_the_metrics(pki):
    tls = config.MetricsTls(cert_file=str(pki / "server.pem"), key_file=str(pki / "server.key"),
                            client_ca_file=str(pki / "ca.pem"))
    reg = CollectorRegistry()
    coll = metrics.SidecarCollector()
    reg.register(coll)
    coll.publish(metrics.SidecarView("n1", placement_waits=3))
    srv = metrics.serve(reg, "127.0.0.1", 0, tls)
    try:
        url = f"https://127.0.0.1:{srv.port}/metrics"
        assert 'antman_placement_waits_total{node="n1"} 3.0' in _get(url, pki, "prometheus")
        for client in (None, "stranger"):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                _get(url, pki, client)
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10).read()
    finally:
        srv.close()


def test_a_missing_tls_file_is_a_clear_error(pki):
    tls = config.MetricsTls(cert_file=str(pki / "server.pem"), key_file=str(pki / "nope.key"),
                            client_ca_file=str(pki / "ca.pem"))
    with pytest.raises(OSError, match="metrics_tls.key_file: .*nope.key is not a readable file"):
        metrics.serve(CollectorRegistry(), "127.0.0.1", 0, tls)
