"""The asyncio SDK and forks on a microvm (QEMU, TCG here): exec and files go through the
node's threaded agent client on the shared executor; a fork stacks the snapshot layer."""

from __future__ import annotations

import asyncio

from dsec_cli.api.aio import AsyncSandbox, close_sessions

from .conftest import IMAGE, leaks


def test_async_microvm_and_fork(node_env: dict[str, str]) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(IMAGE, "microvm", memory="256M") as sb:
            out: list[bytes] = []

            async def acb(kind: str, data: bytes) -> None:
                out.append(data)

            r = await sb.exec("echo $X; cat", env={"X": "vm"}, stdin=b"in", on_output=acb)
            assert (r.exit_code, r.stdout, b"".join(out)) == (0, b"vm\nin", b"vm\nin")
            await sb.write_file("/root/state", "prefix")
            assert await sb.read_file("/root/state") == b"prefix"
            (copy,) = await sb.fork(1)
            try:
                assert copy.backend == "microvm"
                assert await copy.read_file("/root/state") == b"prefix"
                await copy.write_file("/root/state", "copy")
                assert await sb.read_file("/root/state") == b"prefix"
            finally:
                await copy.remove()
        await close_sessions()

    asyncio.run(main())
    assert leaks(node_env["DSEC_STATE_DIR"]) == {"mounts": [], "cgroups": [], "dirs": []}
