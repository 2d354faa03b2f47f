"""`CreateOptions` is the one list of sandbox options: every surface that names them offers
each of them, under its own name, or is named here as offering a part on purpose."""

from __future__ import annotations

import dataclasses
import inspect

import typer

from dsec_cli.api.aio import AsyncSandbox
from dsec_cli.api.sandboxes import Sandbox, create_many, create_options
from dsec_cli.backends import Limits
from dsec_cli.cli import sandbox as cli_sandbox
from dsec_cli.cli.sandbox_io import sandbox_options
from dsec_cli.run.cluster.protocol import from_wire, to_wire
from dsec_cli.run.options import FLAGS, LIMIT_FIELDS, NODE_CHOSEN, CreateOptions

OPTIONS = set(CreateOptions.names())
#: keywords of the SDK's constructors that are not options of the sandbox itself
WHERE = {"state_dir", "store", "node", "remove_at_exit"}


def _keywords(fn: object) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(fn).parameters.items()  # type: ignore[arg-type]
            if n not in ("self", "cls")}


def test_the_sdk_constructors_take_every_option() -> None:
    params = _keywords(Sandbox.__init__)
    assert set(params) - {"image"} == OPTIONS - set(NODE_CHOSEN) | WHERE
    # `AsyncSandbox.create` is `Sandbox(...)` awaited: the same keywords, kinds and defaults
    assert [(p.name, p.kind, p.default, p.annotation) for p in params.values()] == \
        [(p.name, p.kind, p.default, p.annotation)
         for p in _keywords(AsyncSandbox.create).values()]


def test_create_options_takes_every_option() -> None:
    # record_seconds: a lazy mount's profiling window, set by the node's config only
    assert set(_keywords(create_options)) == OPTIONS - {"record_seconds"} | {"prefix"}
    cli = set(_keywords(sandbox_options)) - {"image", "timeout", "node_name"}
    assert cli == OPTIONS - {"record_seconds"}


def test_create_many_takes_the_options_a_batch_is_placed_with() -> None:
    # a batch over cluster nodes: no egress allowlist (its host rules name one node), no
    # user (each node resolves users against its own image files)
    batch = set(_keywords(create_many)) - {"n", "image", "nodes", "parallel"}
    assert batch == OPTIONS - set(NODE_CHOSEN) - {"egress", "user"}


def test_dsec_run_has_a_flag_for_every_option() -> None:
    app = typer.Typer()
    app.callback()(lambda: None)
    cli_sandbox.register(app)
    run = typer.main.get_command(app).get_command(None, "run")  # type: ignore[attr-defined]
    flags = {opt for p in run.params for opt in getattr(p, "opts", [])}
    for name in OPTIONS - {"record_seconds"}:
        assert FLAGS.get(name, "--" + name.replace("_", "-")) in flags, name


def test_limits_and_the_wire_derive_from_the_options() -> None:
    assert tuple(f.name for f in dataclasses.fields(Limits)) == LIMIT_FIELDS
    assert set(LIMIT_FIELDS) <= OPTIONS
    from dsec_cli.run import migrate, pool

    assert set(pool.KEY_FIELDS) <= OPTIONS
    assert set(migrate._LIMIT_KEYS) == set(LIMIT_FIELDS)
    opts = CreateOptions(backend="fncall", cpus=0.5, memory=64 << 20, env={"A": "1"},
                         egress=["host:80"], network="allowlist", user="nobody")
    assert set(to_wire(opts)) == OPTIONS
    assert from_wire(CreateOptions, to_wire(opts)) == opts
    assert Limits(**opts.limits()) == Limits(cpus=0.5, memory=64 << 20)
