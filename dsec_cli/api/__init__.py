"""The public Python API, one module per area: `images` (build, ls, inspect, export, rmi),
`store` (push, pull, gc), `sandboxes` (run, create, exec, cp, snapshot, ps, pause, resume, rm;
`Sandbox`, `FunctionPool`) and `cluster` (nodes, placement, fan-outs, the node service).

The CLI and the package root import only from here; the modules load lazily so that
`dsec --help` stays fast."""
