"""The pool key of active-active peer sync (epp/peer_sync.py): one ZeroMQ CURVE keypair shared by every EPP replica
of a pool, read from a ZeroMQ certificate file (`--peer-sync-key-file`, the `.key_secret` format of
zmq.auth.create_certificates, which `kvgate peer-sync-keygen PATH` writes), and the CURVE settings of the peer-sync
sockets.

Each replica's PUB is a CURVE server with the pool's secret key; its ZAP handler (pyzmq's ThreadAuthenticator)
admits only a client whose public key is the pool's, and CURVE makes a client prove it holds that key's secret half
in the handshake: without the key file nothing subscribes. Each SUB is a CURVE client with the pool's keypair that
expects the pool's public key of its server: a publisher without the secret key cannot complete the handshake, so
nothing it sends is received. Every message after the handshake is encrypted and authenticated (CurveZMQ:
Curve25519, XSalsa20-Poly1305). One key for the pool, not one per replica: a replica set's pods are alike, and
one Secret serves them all; rotating it means restarting the replicas with the new file.
"""

from __future__ import annotations

import hmac
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvgate.common.errors import ConfigError


MAX_KEY_FILE_BYTES = 64 * 1024  # a certificate is ~400 bytes; a larger file is the wrong file
ZAP_DOMAIN = "kvgate-peer-sync"  # the PUB's ZAP domain: the authenticator's policy applies to it alone


class PeerSyncKeyError(ConfigError):
    """A key file that cannot serve, or peer-sync flags that contradict each other (kvgate's CLI: one line, exit 2)."""


@dataclass(frozen=True)
class PoolKey:
    """The pool's CURVE keypair, each half Z85-encoded (40 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)


def load_pool_key(path: str | os.PathLike) -> PoolKey:
    """The keypair in a certificate file with a public-key and its secret-key; PeerSyncKeyError saying why not."""
    where = f"--peer-sync-key-file {path}"
    try:
        info = os.stat(path)  # follows a Kubernetes Secret volume's symlinks
    except OSError as exc:
        raise PeerSyncKeyError(f"{where}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise PeerSyncKeyError(f"{where}: not a regular file")
    if info.st_size > MAX_KEY_FILE_BYTES:
        raise PeerSyncKeyError(f"{where}: {info.st_size} bytes, not a ZeroMQ certificate (at most "
                               f"{MAX_KEY_FILE_BYTES})")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise PeerSyncKeyError(f"{where}: {exc.strerror or exc}") from None
    except ValueError:  # pyzmq's "No public key found"
        raise PeerSyncKeyError(f"{where}: no public-key line: not a ZeroMQ certificate (make one with "
                               f"kvgate peer-sync-keygen PATH)") from None
    if secret is None:
        raise PeerSyncKeyError(f"{where}: no secret-key: a public certificate; give the .key_secret file, which "
                               f"holds both halves")
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError):
        raise PeerSyncKeyError(f"{where}: the secret-key is not a 40-character Z85 CURVE key") from None
    if not hmac.compare_digest(derived, public):
        raise PeerSyncKeyError(f"{where}: the public-key is not the secret-key's")
    return PoolKey(public, secret)


def write_pool_key(path: str | os.PathLike) -> PoolKey:
    """A new pool keypair in a certificate file at `path` (mode 0600; an existing file is never replaced)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise PeerSyncKeyError(f"{path} exists: remove it first to make a new key (and give the new one to every "
                               f"replica)")
    if not path.parent.is_dir():
        raise PeerSyncKeyError(f"{path}: no directory {str(path.parent)!r}")
    scratch = tempfile.mkdtemp(prefix=".peer-sync-key-", dir=path.parent)  # 0700: the secret is never readable
    try:
        _, secret_file = zmq.auth.create_certificates(scratch, "pool")
        os.chmod(secret_file, 0o600)
        os.link(secret_file, path)  # refuses a file that appeared meanwhile
    except OSError as exc:
        raise PeerSyncKeyError(f"{path}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return load_pool_key(path)


class _PoolKeyOnly:
    """The authenticator's allowed-keys check: a subscriber's public key must be the pool's (runs on the
    authenticator's thread)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


class CurvePublisher:
    """A PUB socket's CURVE server side: the pool's secret key, and a ZAP handler on its context admitting only the
    pool's key. Set up before the socket binds; stop() after the socket is closed, before the context ends."""

    def __init__(self, context: zmq.Context, sock: zmq.Socket, key: PoolKey) -> None:
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_PoolKeyOnly(key.public))
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_secretkey = key.secret
        sock.curve_publickey = key.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()


def curve_subscriber(sock: zmq.Socket, key: PoolKey) -> None:
    """A SUB socket's CURVE client side: the pool's keypair, and the pool's public key expected of every publisher.
    Set before the socket connects."""
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_serverkey = key.public


def new_pool_key_text() -> str:
    """A new pool keypair as the text of a ZeroMQ certificate file (what load_pool_key reads): for a key that is
    stored elsewhere than a local file, such as the Kubernetes Secret the operator makes per active-active pool."""
    public, secret = zmq.curve_keypair()
    return ("# kvgate peer sync pool key (ZeroMQ CURVE certificate)\nmetadata\ncurve\n"
            f'    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n')
