"""The sandbox fixtures of tests/run (a store with the busybox image, one node per module)
for the framework adapters' tests."""

from tests.run.conftest import (  # noqa: F401  (fixtures)
    IMAGE,
    dsec_home,
    leaks,
    node,
    node_env,
    requires_root,
    sandbox_data,
    store_url,
)
