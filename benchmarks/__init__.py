"""On-demand benchmarks: each module measures dsec against peers in the same run and writes
its figures to benchmarks/results/<name>.json (quoted in docs/benchmarks.md)."""
