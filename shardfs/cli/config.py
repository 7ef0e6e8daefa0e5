"""Mount settings from a YAML file, `-o` mount options and command-line flags.

Precedence: built-in defaults < the config file < `-o` options < explicit flags. Every key
is validated; an error names the key, the bad value and what is allowed. Unknown keys are
errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardfs.util.sizes import UNITS_HELP, parse_size


class ConfigError(ValueError):
    """A setting that is unknown or has a bad value; the message says what is allowed."""


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a size")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("expected a positive size")
        return value
    size = parse_size(_str(value))
    if size <= 0:
        raise ValueError("expected a positive size")
    return size


def _rate(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number of requests per second") from None
    if isinstance(value, bool) or not number > 0:
        raise ValueError("expected a number > 0")
    return number


def _size_or_zero(value: Any) -> int:
    """A size, where 0 (or "0") switches the feature off."""
    if value == 0 or value == "0":
        return 0
    return _size(value)


def _seconds(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number of seconds") from None
    if isinstance(value, bool):
        raise ValueError("expected a number of seconds")
    return number


def _positive_float(value: Any) -> float:
    number = _seconds(value)
    if not number > 0:
        raise ValueError("expected a number > 0")
    return number


def _seconds_or_zero(value: Any) -> float:
    """Seconds >= 0, where 0 switches the feature off."""
    number = _seconds(value)
    if not 0 <= number < float("inf"):
        raise ValueError("expected a number of seconds >= 0")
    return number


def _positive_int(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError("expected a whole number") from None
    if isinstance(value, bool) or number < 1 or str(number) != str(value).strip():
        raise ValueError("expected a whole number >= 1")
    return number


def _id(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError("expected a numeric uid/gid") from None
    if isinstance(value, bool) or number < 0:
        raise ValueError("expected a numeric uid/gid >= 0")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", ""):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _in_place(value: Any) -> str:
    """off, on or auto; a boolean (YAML's true, -o in_place) is on or off."""
    if str(value).strip().lower() == "auto":
        return "auto"
    return "on" if _bool(value) else "off"


def _choice(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    return parse


def _sources(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v
                                                          for v in value):
        raise ValueError("expected a shard URL/pattern or a non-empty list of them")
    return list(value)


def _host_port(value: Any) -> str:
    text = _str(value)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9100")
    return text


# S3's keys, and the query every http(s) request carries (a signed URL's token: an Azure SAS).
_SECRET_KEYS = ("access_key_id", "secret_access_key", "session_token", "url_query")


def _credentials(value: Any) -> dict[str, dict[str, str]]:
    """Secrets by reference only: {key: {env: NAME}} or {key: {file: PATH}}; never inline."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of {', '.join(_SECRET_KEYS)}")
    out = {}
    for key, ref in value.items():
        if key not in _SECRET_KEYS:
            raise ValueError(f"unknown credential {key!r}; allowed: {', '.join(_SECRET_KEYS)}")
        if not isinstance(ref, dict) or len(ref) != 1 or next(iter(ref)) not in ("env", "file"):
            raise ValueError(f"credentials.{key} must be {{env: VARIABLE}} or {{file: PATH}} "
                             "(secrets are never written inline)")
        kind, where = next(iter(ref.items()))
        out[key] = {kind: _str(where)}
    return out


@dataclass(frozen=True, slots=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    default: Any
    allowed: str  # what the error message says is allowed


OPTIONS: dict[str, Option] = {o.key: o for o in (
    Option("sources", _sources, None, "a shard URL/pattern or a list of them"),
    Option("mountpoint", _str, None, "a directory path"),
    Option("cache_dir", _str, None, "a directory path"),
    Option("cache_size", _size, None, f"a size ({UNITS_HELP})"),
    Option("timeout", _positive_float, 10.0, "seconds > 0"),
    Option("deadline", _positive_float, 60.0, "seconds > 0"),
    Option("max_fetches", _positive_int, 8, "a whole number >= 1"),
    Option("max_member_fetches", _positive_int, 32, "a whole number >= 1"),
    Option("cold_start", _seconds_or_zero, 1.0, "seconds >= 0, 0: off"),
    Option("lookahead_buffer", _size_or_zero, 64 << 20, f"a size ({UNITS_HELP}), 0: off"),
    Option("lookahead_requests", _positive_int, 16, "a whole number >= 1"),
    Option("lookahead_fill", _bool, True, "true or false (on or off)"),
    Option("prefetch", _choice("touched", "all"), "touched", "touched or all"),
    Option("push_pages", _choice("auto", "off"), "auto", "auto or off"),
    Option("split_fetches", _bool, False, "true or false (on or off)"),
    Option("small_windows", _bool, True, "true or false (on or off)"),
    Option("in_place", _in_place, "auto", "auto, on or off (true/false: on/off)"),
    Option("verify", _choice("auto", "sha256"), "auto", "auto or sha256"),
    Option("index_parallel", _positive_int, 8, "a whole number >= 1"),
    Option("workers", _positive_int, None, "a whole number >= 1"),
    Option("warm_while_indexing", _bool, True, "true or false"),
    Option("allow_other", _bool, False, "true or false"),
    Option("nonempty", _bool, False, "true or false"),
    Option("uid", _id, None, "a numeric uid"),
    Option("gid", _id, None, "a numeric gid"),
    Option("log_level", _choice("debug", "info", "warning", "error"), "info",
           "debug, info, warning or error"),
    Option("log_file", _str, None, "a file path"),
    Option("metrics_listen", _host_port, None, "HOST:PORT"),
    Option("credentials", _credentials, None, "{key: {env: NAME} | {file: PATH}}"),
    Option("s3_endpoint", _str, None, "a URL, e.g. http://minio.example:9000"),
    Option("s3_region", _str, None, "an AWS region name"),
    Option("s3_profile", _str, None, "a profile in ~/.aws/credentials or ~/.aws/config"),
    Option("s3_addressing", _choice("auto", "path", "virtual"), "auto", "auto, path or virtual"),
    Option("ais_endpoint", _str, None, "a URL, e.g. http://aistore.example:51080"),
    Option("hf_endpoint", _str, None, "a URL, e.g. https://huggingface.co"),
    Option("gs_endpoint", _str, None, "a URL, e.g. https://storage.googleapis.com"),
    Option("request_rate", _rate, None, "requests per second > 0"),
    Option("http_client", _choice("auto", "httpx"), "auto", "auto or httpx"),
)}

# Generic mount(8)/fstab options that mean nothing to shardfs (it is always read-only).
_IGNORED_MOUNT_OPTIONS = frozenset((
    "ro", "rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group",
    "_netdev", "nofail", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime",
    "noatime", "relatime", "strictatime", "lazytime", "sync", "async", "silent", "loud",
))
# -o spellings of boolean flags (mount options use '_' or '-').
_MOUNT_ALIASES = {"no_warm": ("warm_while_indexing", "false"), "config": ("config", None)}


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, OPTIONS, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def validate(raw: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Check and convert settings; ConfigError names the key, the value and what is allowed."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        option = OPTIONS.get(key)
        if option is None:
            raise ConfigError(f"{origin}: unknown key {key!r}{_suggest(key)}; known keys: "
                              f"{', '.join(OPTIONS)}")
        try:
            out[key] = option.parse(value)
        except ValueError as exc:
            shown = "<hidden>" if key == "credentials" else repr(value)
            raise ConfigError(f"{origin}: {key}: bad value {shown}: {exc} "
                              f"(allowed: {option.allowed})") from None
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings at the top level")
    return validate(data, f"config file {path}")


def parse_mount_options(text: str) -> tuple[dict[str, Any], str | None]:
    """`-o a,b=c` as given by mount(8)/fstab; returns (settings, config file or None)."""
    raw: dict[str, Any] = {}
    config = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.replace("-", "_")
        if key in _IGNORED_MOUNT_OPTIONS or key.startswith(("x_", "comment")):
            continue
        if key in _MOUNT_ALIASES:
            target, forced = _MOUNT_ALIASES[key]
            if target == "config":
                config = value or None
                continue
            key, value, sep = target, forced, "="
        option = OPTIONS.get(key)
        if option is None:
            raise ConfigError(f"-o: unknown option {key!r}{_suggest(key)}")
        raw[key] = value if sep else True
    return validate(raw, "-o"), config


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults, then each layer in order; None in a layer means 'not given'."""
    out = {key: option.default for key, option in OPTIONS.items()}
    for layer in layers:
        out.update({k: v for k, v in layer.items() if v is not None})
    return out


def source_secrets(refs: Mapping[str, Mapping[str, str]] | None) -> dict[str, Any]:
    """The config's `credentials` as SourceSettings fields: `s3_credentials` (S3's keys, or
    None), `url_query` (None: not given, the environment may give it) and, where that came
    from a file, `url_query_file` (read again when a request is refused)."""
    secrets = resolve_credentials(refs)
    url_query = secrets.pop("url_query", None)
    ref = (refs or {}).get("url_query") or {}
    return {"s3_credentials": secrets or None, "url_query": url_query,
            "url_query_file": os.path.abspath(ref["file"]) if "file" in ref else None}


def resolve_credentials(refs: Mapping[str, Mapping[str, str]] | None) -> dict[str, str]:
    """Read secrets referenced by the config; errors name the reference, never the secret."""
    out: dict[str, str] = {}
    for key, ref in (refs or {}).items():
        kind, where = next(iter(ref.items()))
        if kind == "env":
            value = os.environ.get(where)
            if value is None:
                raise ConfigError(f"credentials.{key}: environment variable {where} is not set")
        else:
            try:
                value = Path(where).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"credentials.{key}: cannot read {where}: {exc.strerror}") \
                    from None
        out[key] = value
    return out
