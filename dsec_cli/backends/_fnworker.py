"""The fncall pool worker: runs inside a bwrap sandbox as a fork server ("zygote").

Reads requests (u32 length + pickle) on stdin and answers on stdout. Each call runs in a
fresh fork, so nothing one call does is seen by the next; the worker itself only unpickles
the request (importing the callable's module once, for all later calls). Standalone: it
imports nothing from dsec, since it runs with the host's Python in a read-only view.
"""

import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import traceback


def _read(f, n):
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _child(req, w):
    os.setsid()
    if req.get("memory"):
        resource.setrlimit(resource.RLIMIT_AS, (req["memory"], req["memory"]))
    try:
        if req["kind"] == "call":
            value = ("ok", req["fn"](*req["args"], **req["kwargs"]))
        else:
            p = subprocess.run(req["argv"], input=req.get("stdin"), capture_output=True,
                               cwd=req.get("cwd") or None)
            value = ("ok", (p.returncode, p.stdout, p.stderr))
        data = pickle.dumps(value, protocol=4)
    except BaseException as e:  # reported to the caller, never raised here
        data = pickle.dumps(("err", type(e).__name__, str(e), traceback.format_exc()))
    with os.fdopen(w, "wb") as out:
        out.write(data)
    os._exit(0)


def serve():
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        hdr = _read(inp, 4)
        if hdr is None:
            return
        try:
            req = pickle.loads(_read(inp, struct.unpack(">I", hdr)[0]))
        except BaseException as e:
            reply = pickle.dumps(("err", type(e).__name__, str(e), traceback.format_exc()))
            out.write(struct.pack(">I", len(reply)) + reply)
            out.flush()
            continue
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(req, w)
        os.close(w)
        chunks, timed_out = [], False
        deadline = req.get("timeout")
        while True:
            ready, _, _ = select.select([r], [], [], deadline)
            if not ready:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                break
            b = os.read(r, 1 << 20)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if timed_out:
            reply = pickle.dumps(("timeout",))
        elif chunks:
            reply = b"".join(chunks)
        else:
            reply = pickle.dumps(("died", os.waitstatus_to_exitcode(status)))
        out.write(struct.pack(">I", len(reply)) + reply)
        out.flush()


if __name__ == "__main__":
    serve()
