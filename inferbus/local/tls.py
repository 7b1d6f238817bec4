"""TLS for a local platform (`inferbus up --tls`): a CA of its own and a server certificate for
nats-server, made with the `cryptography` library.

The CA exists only to sign the one server certificate (for `localhost` and `127.0.0.1`) and is
made anew at every start, like the platform's passwords; services verify the server against it
(`NATS_TLS_CA`), so a client that does not trust this CA, or that speaks plaintext, is refused.
Private keys are written 0600 (`write_private`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from inferbus.local.private_files import private_dir, write_private

VALID_FOR = dt.timedelta(days=30)  # longer than any local run; a new pair is made at every start


@dataclass(frozen=True)
class LocalTLS:
    ca_file: Path  # the CA certificate services verify the server with (NATS_TLS_CA)
    cert_file: Path  # the server's certificate (nats-server's tls.cert_file)
    key_file: Path  # its private key (0600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "inferbus local platform"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_local_tls(directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                   client_auth: bool = False) -> LocalTLS:
    """Write a new CA and a server certificate for `hosts` (DNS names or IP addresses) signed by it
    into `directory` (0700). With `client_auth` the certificate may also authenticate its holder
    as a client: nats-servers of a cluster present theirs to each other on routes."""
    private_dir(directory)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    server_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("inferbus local CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_name)
              .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                    *([ExtendedKeyUsageOID.CLIENT_AUTH] if client_auth else [])]),
                             critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    tls = LocalTLS(directory / "ca.pem", directory / "nats-server.pem", directory / "nats-server.key")
    write_private(tls.ca_file, ca.public_bytes(pem).decode())
    write_private(tls.cert_file, server.public_bytes(pem).decode())
    write_private(tls.key_file, server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()).decode())
    return tls
