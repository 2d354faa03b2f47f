"""dsec: content-addressed layers and sandboxes for agentic-RL environments.

The public Python API, importable from the package root; names load lazily so that the
command line starts fast::

    import dsec_cli as dsec

    dsec.build_specs(["layerspecs"])
    with dsec.Sandbox("demo@1") as sb:
        print(sb.exec(["hello"]).stdout)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# module -> {root name: attribute}. Stage names (build, push, run) are subpackages, so the
# functions of the same names are exported under longer names.
_SOURCES: dict[str, dict[str, str]] = {
    "dsec_cli.api.images": {
        "build_specs": "build", "list_images": "list_images", "inspect": "inspect",
        "export_image": "export_image", "open_store": "open_store",
        "prepare_image": "prepare_image", "resolve_image": "resolve_image",
        "BuildReport": "BuildReport", "Built": "Built", "rmi": "rmi",
    },
    "dsec_cli.api.store": {"push_refs": "push", "pull_refs": "pull", "gc_store": "gc_store",
                           "verify_store": "verify_store", "VerifyReport": "VerifyReport"},
    "dsec_cli.api.sandboxes": {
        "Sandbox": "Sandbox", "ExecResult": "ExecResult", "FunctionPool": "FunctionPool",
        "FunctionCallError": "FunctionCallError", "run_sandbox": "run",
        "list_sandboxes": "list_sandboxes", "gc_node": "gc_node", "create_many": "create_many",
    },
    "dsec_cli.api.aio": {"AsyncSandbox": "AsyncSandbox", "close_sessions": "close_sessions"},
    "dsec_cli.api.process": {"AsyncProcess": "AsyncProcess"},
    "dsec_cli.api.oci": {"import_image": "import_image", "import_images": "import_images",
                         "export_oci": "export_oci", "ImportReport": "ImportReport",
                         "ImportRun": "ImportRun", "ExportReport": "ExportReport"},
    "dsec_cli.api.jobs": {"Job": "Job"},
    "dsec_cli.api.pools": {"list_pools": "list_pools", "set_pool": "set_pool",
                           "fill_pools": "fill_pools", "drain_pools": "drain_pools"},
    "dsec_cli.api.grading": {"grade": "grade", "GradeResult": "GradeResult",
                             "start_task": "start_task", "git_scrub_layer": "git_scrub_layer",
                             "git_check": "git_check"},
    "dsec_cli.api.aio_jobs": {"AsyncJob": "AsyncJob"},
    "dsec_cli.core.errors": {"DsecError": "DsecError", "UsageError": "UsageError",
                             "NotFoundError": "NotFoundError",
                             "SandboxError": "SandboxError"},
}
_EXPORTS = {name: (mod, attr) for mod, names in _SOURCES.items() for name, attr in names.items()}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'dsec_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
