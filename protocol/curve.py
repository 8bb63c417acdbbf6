"""ZeroMQ CURVE encryption of the engine's sockets: one key pair per job.

`spmdrun keys DIR` writes the pair: DIR/job.key (the public key: give it to every client and
node) and DIR/job.key_secret (the secret key: only the node that runs the scheduler needs
it, readable by its owner only). The scheduler's client and worker sockets are CURVE servers
with the secret key; clients, workers and launchers are CURVE clients that know the server's
public key (each with a key pair of its own, made fresh). Frames are then encrypted and the
server authenticated; who may send requests is still decided by the auth token, which now
travels encrypted too."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

PUBLIC_FILE = "job.key"
SECRET_FILE = "job.key_secret"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes               # Z85, 40 bytes
    secret: bytes | None = None  # Z85; None where only the public key was given


class CurveKeyError(ValueError):
    """Keys missing, unreadable or malformed; the message says what to do."""


def make_job_keys(directory: str | os.PathLike) -> tuple[Path, Path]:
    """Write a fresh job key pair into `directory` (made if missing); the secret file is
    readable by its owner only. Returns (public file, secret file)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / PUBLIC_FILE, folder / SECRET_FILE
    if public_path.exists() or secret_path.exists():
        raise CurveKeyError(f"{folder} already holds job keys; remove them first or pick another "
                        "directory")
    public, secret = zmq.curve_keypair()
    descriptor = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(_key_file_text("the job's key pair: keep it secret", public, secret))
    public_path.write_text(_key_file_text("the job's public key: give it to clients and nodes",
                                          public))
    return public_path, secret_path


def _key_file_text(comment: str, public: bytes, secret: bytes | None = None) -> str:
    """ZeroMQ's certificate format (ZPL), as zmq.auth.load_certificate reads it."""
    lines = [f"#   spmd-runtime: {comment}", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def load_keys(path: str | os.PathLike, *, need_secret: bool) -> CurveKeys:
    """The keys in `path`: a directory made by `spmdrun keys`, a job.key / job.key_secret file,
    or (for a public key) the 40-character Z85 key itself."""
    text = os.fspath(path)
    if len(text) == 40 and not os.path.exists(text):
        if need_secret:
            raise CurveKeyError("the scheduler's node needs the secret key: give --curve-keys the "
                            f"directory made by `spmdrun keys` (it holds {SECRET_FILE})")
        return CurveKeys(public=_checked_z85(text.encode(), "public key"))
    file = Path(text)
    if file.is_dir():
        file = file / (SECRET_FILE if (need_secret or (file / SECRET_FILE).exists())
                       else PUBLIC_FILE)
    if not file.exists():
        raise CurveKeyError(f"no CURVE key at {file}: make the job's keys with `spmdrun keys DIR` "
                        "and give --curve-keys DIR (clients: the public key, DIR/job.key)")
    try:
        public, secret = zmq.auth.load_certificate(str(file))
    except (OSError, ValueError) as error:
        raise CurveKeyError(f"cannot read the CURVE key file {file}: {error}") from None
    if need_secret and not secret:
        raise CurveKeyError(f"{file} holds only a public key; the scheduler's node needs "
                        f"{SECRET_FILE} (made with it by `spmdrun keys`)")
    return CurveKeys(public=_checked_z85(public, "public key"),
                     secret=_checked_z85(secret, "secret key") if secret else None)


def _checked_z85(key: bytes, what: str) -> bytes:
    try:
        raw = zmq.utils.z85.decode(key)
    except (ValueError, KeyError):
        raw = b""
    if len(key) != 40 or len(raw) != 32:
        raise CurveKeyError(f"malformed CURVE {what}: expected 40 Z85 characters (as `spmdrun keys` "
                        "writes)")
    return key


@functools.lru_cache(maxsize=8)
def _cached_keys(path: str, need_secret: bool) -> CurveKeys:
    return load_keys(path, need_secret=need_secret)


def socket_keys(keys_path: str, address: str, *, server: bool) -> CurveKeys | None:
    """The CURVE keys of the engine socket at `address` (server: the side that binds it):
    None without --curve-keys, or where the address is loopback or ipc (never on the wire)."""
    from spmd_runtime.protocol.config import is_local_address
    if not keys_path or is_local_address(address):
        return None
    return _cached_keys(keys_path, server)


def rpc_server_key(config) -> str:
    """What a client of this engine's own RPC address passes as server_key ("" for none)."""
    return "" if socket_keys(config.curve_keys, config.rpc_address, server=False) is None \
        else config.curve_keys


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it binds) a CURVE server with the job's key pair."""
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public


def secure_client(sock: zmq.Socket, server_public: bytes) -> None:
    """Make `sock` (before it connects) a CURVE client of the server with this public key."""
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
