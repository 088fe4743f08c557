"""Task addresses: ``host:port`` parsing and checks, one spelling per host; and what every
cluster check builds its errors with (the ConfigError builder, a user's value shown)."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from psctl.cluster.errors import ECHO_LIMIT, ConfigError, echo

# A DNS label (underscores allowed, as many internal names have them); a host name is one or
# more of them joined by dots: no empty label, so never "." or "..".
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_NUMERIC_HOST = re.compile(r"[0-9.]*[0-9][0-9.]*")  # digits and dots: must be IPv4
_SCOPE_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")  # an IPv6 zone: an interface name or number
_MAX_HOST = 253


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def config_error(field: str, problem: str, fix: str) -> ConfigError:
    """A ConfigError whose field, problem and fix are one line each (a newline shown as
    ``\\n``), so ``str(err)`` stays one line."""
    return ConfigError(_one_line(field), _one_line(problem), _one_line(fix))


class LongInteger:
    """A JSON integer too long for int() (sys.get_int_max_str_digits): decoded as this, so
    the check of the field it is in names that field. Here, beside the display that shows it."""

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {len(self.digits.lstrip('-'))} digits"


def kind(value: object) -> str:
    """The JSON kind of a decoded value, with its article."""
    if isinstance(value, LongInteger):
        return "a number"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"


def show(value: object) -> str:
    """A short, one-line rendering of a user's value, as JSON writes it where it can."""
    if isinstance(value, str) and len(value) > ECHO_LIMIT:
        return echo(value)
    if isinstance(value, LongInteger):
        return repr(value)
    if isinstance(value, (list, dict)) or (isinstance(value, int) and value.bit_length() > 64):
        return echo(value)  # cut before rendering: it may be huge or deeply nested
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return echo(value)
    return text if len(text) <= ECHO_LIMIT else text[: ECHO_LIMIT - 3] + "..."


def _check_host(host: str, *, field: str, shown: str) -> None:
    """ConfigError unless ``host`` is an IPv4 address or a host name (labels joined by dots)."""
    if len(host) > _MAX_HOST:
        problem = f"is longer than {_MAX_HOST} characters"
    elif _NUMERIC_HOST.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
            return
        except ValueError:
            problem = "is not a valid IPv4 address"
    elif all(_LABEL.fullmatch(label) for label in host.split(".")):
        return
    else:
        problem = "is not a valid host name"
    raise config_error(
        field,
        f"address {shown}: {show(host)} {problem}",
        "use an IP address or a host name: labels of letters, digits, '-' and '_' "
        "(at most 63 each) joined by single dots",
    )


def split_host_port(address: str, *, field: str, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:2222``) into host (brackets removed) and port."""
    if not isinstance(address, str):
        raise config_error(
            field, f"is {kind(address)}, not a host:port string", 'write "host:port"'
        )
    shown = show(address)
    if not address:
        raise config_error(field, "is an empty address", 'write "host:port", e.g. "10.0.0.5:2222"')
    if any(ch.isspace() for ch in address):
        raise config_error(field, f"address {shown} contains whitespace", "remove the whitespace")
    if "://" in address:
        raise config_error(
            field,
            f"address {shown} has a URL scheme",
            'give a bare "host:port" without "grpc://" or any other scheme',
        )
    if address.startswith("["):
        close = address.find("]")
        if close < 0:
            raise config_error(
                field, f"address {shown} has no closing ']'", 'write IPv6 as "[::1]:2222"'
            )
        host = address[1:close]
        rest = address[close + 1 :]
        if not host:
            raise config_error(field, f"address {shown} has an empty host", 'write "[::1]:2222"')
        try:
            scope = ipaddress.IPv6Address(host).scope_id
        except ValueError:
            raise config_error(
                field,
                f"address {shown}: {show(host)} is not an IPv6 address",
                "put only IPv6 addresses in brackets; write hostnames and IPv4 as host:port",
            ) from None
        if scope is not None and not _SCOPE_ID.fullmatch(scope):
            raise config_error(
                field,
                f"address {shown}: zone {show(scope)} is not an interface name",
                'write the zone as an interface name or number, e.g. "[fe80::1%eth0]:2222"',
            )
        if not rest.startswith(":"):
            raise config_error(
                field, f"address {shown} has no port", 'write "[host]:port", e.g. "[::1]:2222"'
            )
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise config_error(
                field,
                f"address {shown} has no port",
                f'write "host:port", e.g. "{address if len(address) <= 40 else "host"}:2222"',
            )
        if ":" in host:
            raise config_error(
                field,
                f"address {shown} looks like an unbracketed IPv6 address",
                'put IPv6 hosts in brackets, e.g. "[::1]:2222"',
            )
        if not host:
            raise config_error(
                field,
                f"address {shown} has an empty host",
                'write "host:port", e.g. "localhost:2222"',
            )
        _check_host(host, field=field, shown=shown)
    if not port_text:
        raise config_error(
            field, f"address {shown} has an empty port", "give a port number 1..65535"
        )
    if not (port_text.isascii() and port_text.isdigit()):
        raise config_error(
            field,
            f"address {shown}: port {show(port_text)} is not an integer",
            "give a port number 1..65535",
        )
    # int() refuses thousands of digits; past 5 the port is out of range anyway.
    port = int(port_text) if len(port_text.lstrip("0")) <= 5 else 65536
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        number = port if port < 65536 else echo(port_text, limit=12)
        raise config_error(
            field, f"address {shown}: port {number} is out of range", "give a port number 1..65535"
        )
    return host, port


@dataclass(frozen=True)
class Address:
    """A parsed ``host:port``: the host without IPv6 brackets, and the port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, *, field: str, allow_port_zero: bool = False) -> Address:
        """``split_host_port``'s checks and error lines, as an Address."""
        return cls(*split_host_port(text, field=field, allow_port_zero=allow_port_zero))

    def __str__(self) -> str:
        """``host:port``, an IPv6 host in brackets (``[::1]:2222``)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def with_port(self, port: int) -> Address:
        """The same host on another port (a side port)."""
        return Address(self.host, port)


def canonical_host(host: str) -> str:
    """One spelling per host: host names in lower case (DNS ignores case), IP addresses as
    ``ipaddress`` writes them (``::0001`` -> ``::1``; an IPv4-mapped IPv6 address as IPv4)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)
