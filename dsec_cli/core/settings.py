"""The DSEC_* settings that are not config keys, and where the config files are: what every
`dsec` call reads first (whether a command server takes it), kept to the interpreter's own
modules so that reading them costs nothing (config.py, which imports dataclasses and pathlib,
re-exports them)."""

from __future__ import annotations

import os

SYSTEM_CONFIG = "/etc/dsec/config.yaml"


def config_dir() -> str:
    """The user's config directory (XDG)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(base, "dsec")


def user_config_path() -> str:
    return os.environ.get("DSEC_CONFIG") or os.path.join(config_dir(), "config.yaml")


#: the DSEC_* settings that are not config keys (those are `_ENV` in config.py, and DSEC_MAX_*
#: the store limits there). Every DSEC_* variable is read in this module or config.py:
#: elsewhere through `env`.
ENV_SETTINGS: dict[str, str] = {
    "DSEC_LOG": "log level of the command line and of lazy mount daemons (e.g. INFO)",
    "DSEC_LAZY_SERVER": "how lazy mounts serve reads: kernel (FUSE passthrough) or daemon "
                        "(libfuse); default kernel where the kernel has passthrough",
    "DSEC_STORE_RETRIES": "attempts per store request (a whole number >= 1)",
    "DSEC_LEASE_TTL": "seconds a writer lease lives without renewal (default 600)",
    "DSEC_GC_MARKER_TTL": "seconds a store gc's marker lives without renewal (default 60)",
    "DSEC_NODE_TIMEOUT": "seconds a fan-out waits for each cluster node (default 15)",
    "DSEC_RUNTIME_DIR": "the private directory of runtime sockets, locks and pidfiles "
                        "(default /run/dsec for root, else $XDG_RUNTIME_DIR/dsec when it is "
                        "the user's own, else /tmp/dsec-UID; must be private to the user)",
    "DSEC_SSH_CONTROL_DIR": "where ssh ControlMaster sockets go (default the runtime dir "
                            "ssh; must be private to the user)",
    "DSEC_SSH_TIMEOUT": "seconds ssh may take to connect (default: connect_timeout)",
    "DSEC_SSH_CONFIG": "an ssh config file used instead of ~/.ssh/config",
    "DSEC_SSH_PERSIST": "how long an idle ssh master connection stays (ssh syntax, 600)",
    "DSEC_VM_VERBOSE": "any value: show the guest kernel's full boot log",
    "DSEC_NODE_AGENT": "how the client reaches a node's service: resident (one long-lived "
                       "service per node, the default) or stdio (one per connection)",
    "DSEC_AGENT_DIR": "where a node's resident service keeps its socket, pid and log "
                      "(default the runtime dir node; must be private to the user)",
    "DSEC_CLI_SERVER": "seconds a per-user command server that runs plain local exec, run -d "
                       "and ps stays idle (default 30; 0 or off: commands run in-process)",
    "DSEC_AGENT_IDLE": "seconds a resident node service stays without clients (default 900)",
    "DSEC_PY_WALK": "any value: scan and read build trees in Python, not the compiled walker",
    "DSEC_PY_FUSELOOP": "any value: kernel-served lazy mounts answer every request in "
                        "Python, not in the compiled FUSE loop",
}


def env(name: str, default: str | None = None) -> str | None:
    """A DSEC_* setting from the environment (``default`` when unset); only names listed in
    `ENV_SETTINGS`, so this module stays the one list of what dsec reads."""
    if name not in ENV_SETTINGS:
        raise KeyError(f"{name} is not a declared DSEC_* setting (core/settings.py)")
    return os.environ.get(name, default)
