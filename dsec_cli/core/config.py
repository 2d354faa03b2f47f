"""Layered configuration: defaults < /etc/dsec/config.yaml < user file < ./dsec.yaml <
DSEC_* environment < command-line flags. Errors name the file and the key."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .settings import ENV_SETTINGS, SYSTEM_CONFIG, config_dir, env, user_config_path
from .units import parse_duration, size_value

__all__ = ["ENV_SETTINGS", "env"]  # declared in settings.py, read through here as ever

SYSTEM_FILE = Path(SYSTEM_CONFIG)


def data_home() -> Path:
    """The user's data directory (XDG), where the embedded store and node state live."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "dsec"


def config_home() -> Path:
    return Path(config_dir())


#: the package registries a Dockerfile RUN reaches by default: Debian's mirror and security
#: archive (http and https), PyPI and npm
BUILD_EGRESS = ("deb.debian.org:80", "deb.debian.org:443", "security.debian.org:80",
                "security.debian.org:443", "pypi.org:443", "files.pythonhosted.org:443",
                "registry.npmjs.org:443")


@dataclass
class Config:
    data_dir: str = ""
    store: str = ""
    state_dir: str = ""
    cache_budget: str = "20G"
    kernel: str = ""  # guest kernel for the microvm and vm backends (else the setup cache)
    #: how microvm/vm sandboxes start: cold (boot each) or snapshot (restore a saved boot)
    vm_boot: str = "cold"
    # network waits (durations): a dead store endpoint or SSH node fails within about
    # connect_timeout + read_timeout, retries included (docs/stores.md, docs/cluster.md)
    connect_timeout: str = "10s"
    read_timeout: str = "20s"
    #: node gc reclaims memory from sandboxes idle this long (a duration; "" = never):
    #: docs/density.md
    idle_reclaim: str = ""
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: bounds on store objects read (`StoreLimits` field -> size or count), e.g.
    #: ``limits: {index_json_bytes: 1G, index_entries: 8000000}``
    limits: dict[str, Any] = field(default_factory=dict)
    #: warm pools (run/pool.py `PoolSettings`), e.g. ``pool: {auto: true, memory: 4G}``
    pool: dict[str, Any] = field(default_factory=dict)
    #: where a Dockerfile RUN may connect (HOST:PORT egress rules, backends/egress.py)
    #: unless it says --network=host or none; DSEC_BUILD_EGRESS: the rules comma-separated,
    #: or ``none``: docs/dockerfile.md
    build_egress: list[str] = field(default_factory=lambda: list(BUILD_EGRESS))
    sources: dict[str, str] = field(default_factory=dict)  # key -> where it was set

    def resolve(self) -> Config:
        if not self.data_dir:
            self.data_dir = str(data_home())
        # a relative directory (DSEC_DATA_DIR=work/data) is taken from the working directory,
        # so the store URL and node paths made from it are absolute
        self.data_dir = os.path.abspath(self.data_dir)
        if self.state_dir:
            self.state_dir = os.path.abspath(self.state_dir)
        if not self.store:
            self.store = Path(self.data_dir, "store").as_uri()
        if not self.state_dir:
            root_state = Path("/var/lib/dsec")
            self.state_dir = str(root_state if os.geteuid() == 0 else Path(self.data_dir, "node"))
        return self


_KEYS = {f.name for f in fields(Config)} - {"sources"}
_ENV = {"DSEC_STORE": "store", "DSEC_DATA_DIR": "data_dir", "DSEC_STATE_DIR": "state_dir",
        "DSEC_CACHE_BUDGET": "cache_budget", "DSEC_KERNEL": "kernel",
        "DSEC_VM_BOOT": "vm_boot",
        "DSEC_CONNECT_TIMEOUT": "connect_timeout", "DSEC_READ_TIMEOUT": "read_timeout",
        "DSEC_IDLE_RECLAIM": "idle_reclaim"}


def user_config_file() -> Path:
    return Path(user_config_path())


def read_config_file(path: Path) -> Any:
    """A config file's document (None when empty), read by the one bounded YAML loader;
    a file that is not valid UTF-8 or YAML, or is too large or too deep, is a `ConfigError`
    naming it (and the line where known)."""
    from .yamlfile import load

    def fail(message: str, line: int | None) -> ConfigError:
        return ConfigError(f"{path}:{line}: {message}" if line else f"{path}: {message}")

    return load(path, fail)


def _apply_file(cfg: Config, path: Path) -> None:
    if not path.is_file():
        return
    data = read_config_file(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for key, value in data.items():
        if key not in _KEYS:
            raise ConfigError(f"{path}: unknown key {key!r}", hint=f"known keys: {sorted(_KEYS)}")
        expected = type(getattr(Config(), key))
        if not isinstance(value, expected):
            raise ConfigError(f"{path}: key {key!r} must be a {expected.__name__}")
        setattr(cfg, key, value)
        cfg.sources[key] = str(path)


def load_config(project_dir: Path | None = None, **flags: Any) -> Config:
    cfg = Config()
    _apply_file(cfg, SYSTEM_FILE)
    _apply_file(cfg, user_config_file())
    _apply_file(cfg, (project_dir or Path.cwd()) / "dsec.yaml")
    for var, key in _ENV.items():
        if os.environ.get(var):
            setattr(cfg, key, os.environ[var])
            cfg.sources[key] = f"${var}"
    if os.environ.get("DSEC_BUILD_EGRESS"):
        text = os.environ["DSEC_BUILD_EGRESS"].strip()
        cfg.build_egress = [] if text == "none" else \
            [r for r in text.replace(",", " ").split() if r]
        cfg.sources["build_egress"] = "$DSEC_BUILD_EGRESS"
    for key, value in flags.items():
        if value is not None:
            setattr(cfg, key, value)
            cfg.sources[key] = "flag"
    return cfg.resolve()


def save_user_config(updates: dict[str, Any]) -> Path:
    """Merge keys into the user config file (used by `dsec node add/rm`)."""
    import yaml

    path = user_config_file()
    data: dict[str, Any] = {}
    if path.is_file():
        data = read_config_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    data.update(updates)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=True))
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class NetTimeouts:
    """How long one network operation may wait: to connect, and for each answer."""

    connect: float
    read: float

    @property
    def total(self) -> float:
        """The most one operation spends waiting on a silent endpoint, retries included."""
        return self.connect + self.read


def _positive_duration(cfg: Config, key: str) -> float:
    text = getattr(cfg, key)
    where = cfg.sources.get(key, "the default")
    try:
        value = parse_duration(text, key)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.message}") from None
    if not 0 < value <= 3600:
        raise ConfigError(f"{where}: {key} {text!r} must be more than 0 and at most 1h")
    return value


def net_timeouts() -> NetTimeouts:
    """The resolved network timeouts (config keys connect_timeout / read_timeout, or
    DSEC_CONNECT_TIMEOUT / DSEC_READ_TIMEOUT)."""
    cfg = load_config()
    return NetTimeouts(_positive_duration(cfg, "connect_timeout"),
                       _positive_duration(cfg, "read_timeout"))


def debug_delay(name: str) -> float:
    """Seconds to pause at a named point, from ``DSEC_DEBUG_DELAY_<NAME>`` (tests use it to
    stop a process at a chosen step; unset or malformed means no pause)."""
    raw = os.environ.get(f"DSEC_DEBUG_DELAY_{name.upper()}", "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return value if 0 < value < 3600 else 0.0


@dataclass(frozen=True)
class StoreLimits:
    """Bounds on what a reader accepts from a store (docs/format.md, "Validation").

    Store objects are hostile input: these keep parsing bounded in memory and time. The
    defaults hold a multi-GB image of a million files with room to spare (an index of /usr
    with 20k entries is about 2 MB of JSON). Each can be set as ``limits.<name>`` in a config
    file or as ``DSEC_MAX_<NAME>`` in the environment (sizes take K, M, G suffixes)."""

    manifest_bytes: int = 4 << 20
    ref_bytes: int = 64 << 10
    index_bytes: int = 128 << 20  # stored (compressed) bytes of one index
    index_json_bytes: int = 512 << 20  # decompressed bytes of one index
    index_entries: int = 4_000_000
    index_chunks: int = 8_000_000
    index_packs: int = 1_000_000
    chunk_bytes: int = 64 << 20  # uncompressed bytes of one chunk (and of chunker params)
    pack_trailer_bytes: int = 64 << 20  # decompressed table of contents of one pack
    #: bytes a layer may put on disk per byte of chunks it stores, past `expansion_floor`:
    #: zstd of text reaches 10-20x and files repeating a chunk more; the example layers and a
    #: Debian /usr tree stay under 5x, so 64x leaves room while a crafted index naming a
    #: file of one chunk repeated (thousands of times) is refused before it is written
    expansion: int = 64
    #: bytes any layer may materialize whatever it stores: small layers of repeated or
    #: zero-filled files stay usable
    expansion_floor: int = 256 << 20
    #: layers of one image: overlayfs stacks at most 500 lower dirs (a sandbox adds its own
    #: skeleton on top), and Docker's images stay within 128
    layers: int = 128


_LIMIT_NAMES = tuple(f.name for f in fields(StoreLimits))
_limits_cache: dict[tuple[str | None, ...], StoreLimits] = {}


def _limit(text: str, what: str, where: str = "") -> int:
    """A store limit: a whole number of at least 1 (bytes or a count; K, M, G, T suffixes),
    at most 1E. A limit of 0 or a fraction would make every object look broken, so it is
    refused like any malformed value, naming the key or variable and the value."""
    try:
        value = size_value(text, what)
    except ConfigError as e:
        raise ConfigError(where + e.message) from None
    if value < 1 or not value.is_integer():
        raise ConfigError(f"{where}invalid {what} {text!r}: must be a whole number of at "
                          "least 1")
    return int(value)


def store_limits() -> StoreLimits:
    """The bounds in force: defaults < config files (``limits``) < ``DSEC_MAX_*``.

    Read once per process (and again if a DSEC_MAX_* variable or DSEC_CONFIG changes):
    indexes are loaded on hot paths."""
    env = tuple(os.environ.get(f"DSEC_MAX_{n.upper()}") for n in _LIMIT_NAMES)
    key = (*env, os.environ.get("DSEC_CONFIG"))
    cached = _limits_cache.get(key)
    if cached is not None:
        return cached
    cfg = load_config()
    values: dict[str, int] = {}
    for name, value in cfg.limits.items():
        if name not in _LIMIT_NAMES:
            raise ConfigError(f"{cfg.sources.get('limits', 'config')}: unknown key "
                              f"limits.{name!r}", hint=f"known: {sorted(_LIMIT_NAMES)}")
        where = cfg.sources.get("limits", "config")
        values[name] = _limit(str(value), f"limits.{name}", f"{where}: ")
    for name, text in zip(_LIMIT_NAMES, env, strict=True):
        if text:
            values[name] = _limit(text, f"DSEC_MAX_{name.upper()}")
    limits = StoreLimits(**values)
    _limits_cache[key] = limits
    return limits
