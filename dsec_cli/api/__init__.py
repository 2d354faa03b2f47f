"""The public Python API, one module per area: `images` (build, ls, inspect, export, rmi),
`store` (push, pull, gc), `sandboxes` (run, create, exec, cp, snapshot, ps, pause, resume, rm;
`Sandbox`, `FunctionPool`), `cluster` (nodes, placement, fan-outs, the node service) and
`jobs` (`Job`: leases, rollout groups, the trajectory journal, resume and replay).

The CLI and the package root import only from here; the modules load lazily so that
`dsec --help` stays fast."""
