"""Who may use the control API: bearer tokens, their per-user files, and TLS.

Every ``psctl.control.v1.Control`` call carries ``authorization: Bearer TOKEN``. A job has
two tokens: the control token (every method) and a read-only one (GetStatus, WatchStatus).
The process that launches a job writes both into the user's runtime directory, mode 0600,
named after the control address, so that the same user's `psctl status/stop --address A`
finds them with no flag. On other hosts the operator gives a token file and TLS files
(docs/security.md). No TensorFlow here: `psctl status` imports this.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from psctl.cluster.address import split_host_port
from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import SERVICE_STATE_DIR, env_switch

CONTROL_SERVICE = "/psctl.control.v1.Control/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
# What the read-only token may call: the status reads, and reflection / health.
READ_METHODS = frozenset(
    {
        CONTROL_SERVICE + "GetStatus",
        CONTROL_SERVICE + "WatchStatus",
        HEALTH_WATCH,
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
# Streams held open at once (WatchStatus, health Watch, reflection), over all callers;
# past it a new stream gets RESOURCE_EXHAUSTED. Unary calls have their own threads.
MAX_STREAMS = 128
UNARY_THREADS = 8
EXIT_NOT_ALLOWED = 77  # EX_NOPERM: the coordinator refused the credential

# The PSCTL_* variables of the flags below (settings.OTHER_ENV lists them).
ENV = {
    "token_file": "PSCTL_CONTROL_TOKEN_FILE",
    "read_token_file": "PSCTL_CONTROL_READ_TOKEN_FILE",
    "tls_cert": "PSCTL_CONTROL_TLS_CERT",
    "tls_key": "PSCTL_CONTROL_TLS_KEY",
    "tls_ca": "PSCTL_CONTROL_TLS_CA",
    "insecure": "PSCTL_INSECURE_CONTROL",
}


# -- token files -----------------------------------------------------------------------


def service_runtime_dir() -> Path:
    """The coordinator unit's token directory: its HOME is its state directory. A client
    with no token of its own for an address also looks there, so that root on the
    coordinator's host reaches the unit's job as deploy.md says."""
    return Path(SERVICE_STATE_DIR) / ".local" / "state" / "psctl"


def runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where a user's job tokens live: ``$XDG_RUNTIME_DIR/psctl``, else
    ``~/.local/state/psctl``."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "psctl"
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".local" / "state" / "psctl"


_LOOPBACK_NAMES = {"localhost", "", "0.0.0.0", "::", "[::]"}


def address_key(address: str) -> str:
    """A file name for a control address: loopback spellings share one
    (``localhost:7070`` and ``127.0.0.1:7070`` are one job)."""
    host, port = split_host_port(address, field="--address", allow_port_zero=True)
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES or is_loopback(host):
        host = "127.0.0.1"
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{host}_{port}")


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_private_socket(address: str) -> bool:
    """A ``unix:PATH`` control address: a training process behind its launcher's front
    (operations/front.py), in a directory only the job's user can open."""
    return address.startswith("unix:")


def token_paths(
    address: str, environ: Mapping[str, str] | None = None, *, directory: Path | None = None
) -> tuple[Path, Path]:
    """The (control token, read-only token) files of the job on ``address``, in this
    user's runtime directory (or ``directory``)."""
    base = (directory or runtime_dir(environ)) / address_key(address)
    return base.with_name(base.name + ".token"), base.with_name(base.name + ".read.token")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, mode 0600 from the first byte, replacing it whole; the
    directory is made 0700 and must belong to this user."""
    fix = "set XDG_RUNTIME_DIR (or HOME) to a directory of your own"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.parent.stat()
        if info.st_uid != os.getuid():
            raise ConfigError(str(path.parent), "belongs to another user", fix)
        if info.st_mode & 0o077:  # ours, but others could list or write it
            os.chmod(path.parent, 0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (text + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        raise ConfigError(
            "control token file", f"cannot write {path}: {err.strerror or err}", fix
        ) from None


def read_token(path: str | Path, *, field: str) -> str:
    """The token in ``path`` (one line), or a ConfigError naming ``field``."""
    try:
        text = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(
            field, f"cannot read {path}: {err.strerror}", "give a readable token file"
        ) from None
    if not text or len(text.splitlines()) != 1 or len(text) < 16:
        raise ConfigError(
            field,
            f"{path} does not hold one token of at least 16 characters",
            "write one line, e.g. `openssl rand -base64 32 > FILE`",
        )
    return text


@dataclass(frozen=True)
class Tokens:
    """The job's control token and read-only token."""

    control: str
    read: str

    @classmethod
    def generate(cls) -> Tokens:
        return cls(new_token(), new_token())


class PublishedTokens:
    """The job's tokens in the user's runtime directory, removed again by ``remove``."""

    def __init__(self, address: str, tokens: Tokens) -> None:
        self.tokens = tokens
        self.control_path, self.read_path = token_paths(address)
        write_secret(self.control_path, tokens.control)
        write_secret(self.read_path, tokens.read)

    def remove(self) -> None:
        """Remove the files, unless another job on the address has replaced them."""
        for path, token in (
            (self.control_path, self.tokens.control),
            (self.read_path, self.tokens.read),
        ):
            try:
                if path.read_text().strip() == token:
                    path.unlink()
            except OSError:
                pass


def publish_for_launch(
    address: str, security: ControlSecurity, tokens: Tokens
) -> tuple[PublishedTokens, ControlSecurity]:
    """For a launcher (psctl local, the psctl train supervisor) that listens on ``address``
    already: write the job's ``tokens`` for this user, and return the settings its training
    processes get (the token files), so that every restarted process keeps the same tokens.
    Only once the address is the launcher's: a second job refused the address must not
    replace (and then remove) the running job's token files."""
    published = PublishedTokens(address, tokens)
    child = replace(
        security,
        token_file=str(published.control_path),
        read_token_file=str(published.read_path),
    )
    return published, child


# -- what a server or client is given ---------------------------------------------------


@dataclass(frozen=True)
class ControlSecurity:
    """The control flags of one process: token files, TLS files, --insecure-control.

    On the coordinator ``tls_cert``/``tls_key`` are its certificate and ``tls_ca`` the
    client CA (mTLS); on the client commands ``tls_ca`` checks the coordinator's certificate
    and ``tls_cert``/``tls_key`` are the client's own (mTLS).
    """

    token_file: str = ""
    read_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    insecure: bool = False

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str] | None = None) -> ControlSecurity:
        """Flags (``control_token_file``, ...) win over the PSCTL_* variables."""
        env = os.environ if environ is None else environ

        def pick(name: str) -> str:
            value = getattr(args, f"control_{name}", None)
            return str(value) if value else env.get(ENV[name], "")

        insecure = bool(getattr(args, "insecure_control", False)) or env_switch(
            env, ENV["insecure"]
        )
        return cls(
            token_file=pick("token_file"),
            read_token_file=pick("read_token_file"),
            tls_cert=pick("tls_cert"),
            tls_key=pick("tls_key"),
            tls_ca=pick("tls_ca"),
            insecure=insecure,
        )

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_key or self.tls_ca)

    def as_argv(self) -> list[str]:
        """The same settings as flags, for a child process."""
        argv: list[str] = []
        for name in ("token_file", "read_token_file", "tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if value:
                argv += [f"--control-{name.replace('_', '-')}", value]
        return argv + (["--insecure-control"] if self.insecure else [])

    def check_server(self, address: str) -> None:
        """A coordinator off loopback needs TLS and a token file, or --insecure-control."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                "--control-tls-cert/--control-tls-key", "only one is given", "give both"
            )
        if is_private_socket(address):
            return
        host, _ = split_host_port(address, field="--control-address", allow_port_zero=True)
        if is_loopback(host) or self.insecure:
            return
        missing = [
            flag
            for flag, value in (
                ("--control-tls-cert/--control-tls-key", self.tls_cert),
                ("--control-token-file", self.token_file),
            )
            if not value
        ]
        if missing:
            raise ConfigError(
                "--control-address",
                f"{address} is not loopback, and {' and '.join(missing)} not given",
                "give TLS files and a token file (docs/security.md), or pass "
                "--insecure-control on a network you trust",
            )

    def for_private_socket(self) -> ControlSecurity:
        """What a training process behind a launcher's control front gets: the same token
        files, no TLS (it listens on a Unix socket in the launcher's private directory)."""
        return replace(self, tls_cert="", tls_key="", tls_ca="", insecure=False)

    def server_tokens(self) -> Tokens:
        """The job's tokens: from the token files, new random ones where none is given."""
        control = (
            read_token(self.token_file, field="--control-token-file")
            if self.token_file
            else new_token()
        )
        read = (
            read_token(self.read_token_file, field="--control-read-token-file")
            if self.read_token_file
            else new_token()
        )
        return Tokens(control, read)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        key = _read_bytes(self.tls_key, "--control-tls-key")
        cert = _read_bytes(self.tls_cert, "--control-tls-cert")
        ca = _read_bytes(self.tls_ca, "--control-tls-ca") if self.tls_ca else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def client_token(self, address: str) -> str | None:
        """The token a client sends: --control-token-file, else the job's control token
        file in this user's runtime directory, else its read-only one; else the same in
        the coordinator unit's (readable by root, and by the unit's own user)."""
        if self.token_file:
            return read_token(self.token_file, field="--control-token-file")
        paths = (*token_paths(address), *token_paths(address, directory=service_runtime_dir()))
        for path in paths:
            try:
                return path.read_text().strip() or None
            except OSError:
                continue
        return None

    def channel(self, address: str) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(address)
        ca = _read_bytes(self.tls_ca, "--control-tls-ca") if self.tls_ca else None
        key = _read_bytes(self.tls_key, "--control-tls-key") if self.tls_key else None
        cert = _read_bytes(self.tls_cert, "--control-tls-cert") if self.tls_cert else None
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        return grpc.secure_channel(address, creds)


def _read_bytes(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(
            field, f"cannot read {path}: {err.strerror}", "give a readable file"
        ) from None


def bearer(token: str | None) -> list[tuple[str, str]]:
    """The call metadata that carries ``token``."""
    return [("authorization", f"Bearer {token}")] if token else []


# -- the server side --------------------------------------------------------------------


def _matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Checks the bearer token of every call but a health Check, and bounds the streams
    held open at once (``max_streams``)."""

    def __init__(self, tokens: Tokens, *, max_streams: int = MAX_STREAMS) -> None:
        self.tokens = tokens
        self.max_streams = max_streams
        self._streams = 0
        self._lock = threading.Lock()

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._streams

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method == HEALTH_CHECK:
            return handler  # unknown methods: UNIMPLEMENTED, as without the interceptor
        denied = self._check(method, details.invocation_metadata or ())
        if denied is not None:
            return _deny(handler, *denied)
        if handler.response_streaming:
            return self._bounded(handler)
        return handler

    def _check(
        self, method: str, metadata: Sequence[tuple[str, Any]]
    ) -> tuple[grpc.StatusCode, str] | None:
        given = next(
            (str(v) for k, v in metadata if k == "authorization" and isinstance(v, str)), None
        )
        if given is None or not given.startswith("Bearer "):
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "no control token sent",
            )
        token = given.removeprefix("Bearer ").strip()
        if _matches(token, self.tokens.control):
            return None
        if _matches(token, self.tokens.read):
            if method in READ_METHODS:
                return None
            name = method.rsplit("/", 1)[-1]
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"the read-only token cannot call {name}; use the job's control token",
            )
        return grpc.StatusCode.UNAUTHENTICATED, "the control token is not this job's"

    def _bounded(self, handler: Any) -> Any:
        limit = self

        def acquire() -> bool:
            with limit._lock:
                if limit._streams >= limit.max_streams:
                    return False
                limit._streams += 1
                return True

        def release() -> None:
            with limit._lock:
                limit._streams -= 1

        def wrap(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def bounded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                if not acquire():
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{limit.max_streams} streams are open, the most this coordinator "
                        "serves at once; close one (psctl status answers meanwhile)",
                    )
                try:
                    yield from behavior(request, context)
                finally:
                    release()

            return bounded

        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(
                wrap(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _deny(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same shape as ``handler`` that answers ``code`` without reading
    the request (not even deserializing it)."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    return kinds[(handler.request_streaming, handler.response_streaming)](abort)


def is_denied(code: grpc.StatusCode | None) -> bool:
    return code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


__all__ = [
    "EXIT_NOT_ALLOWED",
    "AuthInterceptor",
    "ControlSecurity",
    "PublishedTokens",
    "Tokens",
]
