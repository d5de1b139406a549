"""The certificates a test control plane needs: one CA that signs the apiserver's serving cert and
every client cert (users are whoever a cert's CN says, their groups its O entries), and the
service-account signing key.

EC P-256 keys throughout: generating them takes microseconds, where RSA takes tens of milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=2)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, as files."""

    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


class CertificateAuthority:
    """A throwaway CA kept in a directory; issues serving and client certificates."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "migpilot-test-ca")])
        now = datetime.datetime.now(datetime.UTC)
        self._name = name
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pair = KeyPair(
            cert=_write(directory / "ca.crt", self._cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(directory / "ca.key", _key_pem(self._key)),
        )

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: tuple[str, ...] = (),
        server_names: tuple[str, ...] = (),
        server_ips: tuple[str, ...] = (),
    ) -> KeyPair:
        """Write `<name>.crt` and `<name>.key`: a client cert, or a serving one given names."""
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.UTC)
        serving = bool(server_names or server_ips)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                    if serving
                    else [ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if serving:
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
            sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(
            cert=_write(
                self.directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)
            ),
            key=_write(self.directory / f"{name}.key", _key_pem(key)),
        )


def service_account_keys(directory: Path) -> KeyPair:
    """The key the apiserver signs service-account tokens with (`sa.key`) and checks them by
    (`sa.pub`); kube-controller-manager's token controller signs with the same private key."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return KeyPair(
        cert=_write(directory / "sa.pub", public),
        key=_write(directory / "sa.key", _key_pem(key)),
    )
