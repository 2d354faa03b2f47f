"""The cluster side of dsec: nodes reached over SSH, each running `dsec agent`.

- `protocol`: the versioned JSON-lines request/response protocol and error mapping.
- `node_service`: the node service (`dsec agent --stdio`), serving requests against the local Node.
- `admission`: per-node capacity, admitted or refused atomically across processes.
- `ssh`: OpenSSH transport (ControlMaster multiplexing, host keys checked) and channels.
- `remote`: `RemoteNode`, the Node API over a channel.
- `registry`: nodes kept in the user's config (`dsec node add/ls/check/rm`), bootstrap.
- `placement`: scoring nodes by free capacity and cached image bytes.
- `api`: routing node-qualified sandbox ids, placement, fan-out, `create_many`.
"""

from .errors import CapacityError, HostKeyError, NodeCommandError

__all__ = ["CapacityError", "HostKeyError", "NodeCommandError"]
