"""The table of `dsec` commands and the root help made from it alone: a leaf, so the entry
point (``__init__``) and the typer group (group.py) both read it without importing each
other."""

from __future__ import annotations

#: command -> (module in this package that registers it, one-line help). A module that adds
#: commands adds its lines here; tests/test_cli_start.py checks the table against what every
#: module of this package registers.
COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("build", "Build layer and image specs (default: layerspecs/), or a Dockerfile with "
              "--as, into a store."),
    "ls": ("build", "List layers and images in a store."),
    "inspect": ("build", "Show a layer's or image's manifest and index, or a sandbox's state."),
    "export": ("build", "Write an image's merged tree (whiteouts applied) to a directory or a "
                        "tar, or the image as a runnable OCI image (--format oci, "
                        "--to-registry)."),
    "version": ("build", "Print the dsec version."),
    "push": ("store", "Copy layers or images (with their layers) to a store; sends only what it "
                      "lacks."),
    "pull": ("store", "Copy layers or images from a store into the local one; verifies "
                      "everything read."),
    "rmi": ("store", "Remove layer or image refs; `dsec gc` frees what only they reached."),
    "run": ("sandbox", "Create a sandbox; run CMD in it and remove it, or leave it running with "
                       "-d."),
    "exec": ("sandbox", "Run a command in a sandbox: streams output, forwards stdin, exits with "
                        "its code."),
    "cp": ("sandbox", "Copy a file into a sandbox, or a file, symlink or directory out of one "
                      "(one side is [NODE/]SANDBOX:PATH)."),
    "ps": ("sandbox", "List sandboxes: this node's, a cluster node's (--node) or every node's "
                      "(--all-nodes, in parallel; a node that does not answer is reported and "
                      "skipped)."),
    "rm": ("sandbox", "Remove sandboxes (stops everything they run)."),
    "pause": ("sandbox", "Freeze every process of a sandbox (cgroup freezer)."),
    "resume": ("sandbox", "Thaw a paused sandbox."),
    "snapshot": ("sandbox", "Turn a sandbox's changes into a new layer and an image stacking it."),
    "fork": ("sandbox", "Make copies of a sandbox's files: new sandboxes on its node, "
                        "copy-on-write over one snapshot layer where the backend snapshots; "
                        "prints the copies' ids."),
    "gc": ("gc", "Delete what nothing references: store objects no ref or pin reaches (safe "
                 "while others push), and with --node this node's expired sandboxes and least "
                 "recently used layers."),
    "agent": ("node", "The node service of the cluster: serves the node protocol for `dsec "
                      "--node`."),
    "node": ("node", "Cluster nodes reached over SSH (each runs `dsec agent`)."),
    "optimize": ("optimize", "Profiled prefetch: record what IMAGE reads at start (from earlier "
                             "`dsec run --fetch lazy` runs, or by running CMD now) and publish "
                             "layer versions that prefetch it."),
    "verify": ("verify", "Check the objects reachable from refs: one line per bad object, then "
                         "counts."),
    "import": ("oci", "Import OCI or Docker images: each layer becomes a dsec layer, each "
                      "config an image."),
    "journal": ("job", "A rollout's steps (number, key, command, exit code, state digests, "
                       "duration) and its grades (reward, tests passed and failed, tamper)."),
    "replay": ("job", "Rebuild a rollout in a fresh sandbox: its image, its last snapshot, and "
                      "the journal's later steps re-executed with their state digests checked."),
    "job": ("job", "Jobs: sandboxes owned through a lease, with a journal of every exec "
                   "(docs/jobs.md)."),
    "pool": ("pool", "Warm pools: sandboxes made ahead, taken by creates with the same image, "
                     "backend, limits and environment."),
    "git-scrub": ("grade", "Write a new layer: REF with the git repository at --path reduced "
                           "to one commit holding --base's tree (no other commits, tags, "
                           "reflogs, remotes or stray objects)."),
    "git-check": ("grade", "Exit 0 when the repository at --path holds one parentless commit "
                           "and nothing beyond it; else list what reaches past it and exit 1."),
    "start-task": ("grade", "Record the digests of the task's protected paths now (after "
                            "setup, before the agent acts); `dsec grade` reports what the "
                            "agent changed, created or deleted since."),
    "grade": ("grade", "Score SANDBOX in a fork: the task image plus the grader's hidden "
                       "tests, only the agent's changes on the patch surface, no network."),
    "egress": ("grade", "Replace a running sandbox's egress allowlist, enforced on the host's "
                        "side."),
    "park": ("density", "Stop a sandbox and give its memory back (to swap where the node has "
                        "swap)."),
    "thaw": ("density", "Let a parked sandbox run again: the same files and processes."),
    "top": ("density", "Per sandbox: CPU, resident, declared, reclaimed and swapped memory, "
                       "class, idle time; refreshed live on a terminal, one sample with --json "
                       "or --once."),
}

ABOUT = "Content-addressed layers and sandboxes for agentic-RL environments."


def root_help() -> str:
    """`dsec --help`, from the table alone (no command module, typer or rich imported)."""
    import shutil
    import textwrap

    width = max(map(len, COMMANDS)) + 2
    cols = max(60, min(shutil.get_terminal_size().columns, 100))
    lines = ["Usage: dsec [OPTIONS] COMMAND [ARGS]...", "", f"  {ABOUT}", "", "Options:",
             f"  {'--help':<{width}}Show this message and exit.", "", "Commands:"]
    for name, (_, short) in COMMANDS.items():
        lines += textwrap.wrap(short, cols, initial_indent=f"  {name:<{width}}",
                               subsequent_indent=" " * (width + 2))
    return "\n".join(lines) + "\n"
