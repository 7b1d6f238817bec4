"""TLS on the NATS client port: a real nats-server with a certificate from a CA of the test's own,
reached by `bus.connect` (and the billing ledger's own connection) with NATS_TLS_CA, as a
deployment that asks for TLS does; without that CA the connection is refused."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from inferbus.bus import connection as bus
from inferbus.bus.auth import Identity, accounts_block, new_password
from inferbus.bus.connection import BusSettings
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.servers import nats_server_binary
from services.billing.pull import PullConnection

pytestmark = pytest.mark.slow


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
                 *, ca: bool) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.fixture
def tls_nats(tmp_path: Path) -> Iterator[tuple[str, str, Identity]]:
    """(tls:// URL, CA file, a worker identity) of a nats-server that requires TLS and credentials."""
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inferbus test CA")])
    ca = _certificate("inferbus test CA", ca_key, ca_name, ca_key, ca=True)
    server = _certificate("localhost", server_key, ca_name, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    ca_file = _write(tmp_path / "ca.pem", ca.public_bytes(pem))
    cert_file = _write(tmp_path / "server.pem", server.public_bytes(pem))
    key_file = _write(tmp_path / "server.key", server_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    worker = Identity("worker-1", new_password(), "worker", "worker-1")
    ops = Identity("ops", new_password(), "ops")
    port, monitor = free_port(), free_port()
    (tmp_path / "nats.conf").write_text(
        f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{monitor}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        f'tls {{ cert_file: "{cert_file}"\n key_file: "{key_file}" }}\n' + accounts_block([ops, worker]))
    process = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "nats.conf")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not http_ok(f"http://127.0.0.1:{monitor}/healthz"):
            assert time.monotonic() < deadline and process.poll() is None, "nats-server did not start"
            time.sleep(0.05)
        yield f"tls://127.0.0.1:{port}", ca_file, worker
    finally:
        process.terminate()
        process.wait()


def test_services_reach_a_tls_nats_with_the_deployments_ca(tls_nats: tuple[str, str, Identity]) -> None:
    url, ca_file, worker = tls_nats
    settings = BusSettings(user=worker.user, password=worker.password, tls_ca=ca_file)

    async def run() -> None:
        nc = await bus.connect(url, "tls-test", auth=settings)
        try:
            assert nc.is_connected and nc._server_info.get("tls_required")
            # Its permissions hold over TLS as well: its own load report is allowed.
            await nc.publish("inferbus.metrics.worker-1", b"{}")
            await nc.flush()
        finally:
            await nc.close()
        ledger = PullConnection(url, "USAGE", "usage-rollup", auth=settings)
        await ledger.connect()
        await ledger.close()

    asyncio.run(run())


def test_without_the_ca_the_server_is_not_trusted(tls_nats: tuple[str, str, Identity]) -> None:
    url, _, worker = tls_nats

    async def run() -> list[str]:
        errors: list[str] = []

        async def on_error(error: Exception) -> None:
            errors.append(repr(error))

        # The options bus.connect uses, on a connection that gives up at once (bus.connect retries).
        options = BusSettings(user=worker.user, password=worker.password).options(url)
        with pytest.raises(Exception):  # noqa: B017 (nats.py raises several kinds)
            await nats.connect(url, allow_reconnect=False, error_cb=on_error, **options)  # type: ignore[arg-type]
        return errors

    errors = asyncio.run(run())
    assert any("CERTIFICATE_VERIFY_FAILED" in error for error in errors), errors
