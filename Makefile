# The two entry points: `make demo` (install, build the example layers, run a sandbox)
# and `make test` (install with test tools, run the whole suite).
.PHONY: setup setup-dev demo test lint bench

setup:
	scripts/setup.sh

setup-dev:
	scripts/setup.sh --dev

demo: setup
	scripts/demo.sh

# sandboxes, mounts, cgroups and sshd need root: as another user the suite runs through sudo
# (-ra lists every skip in the summary)
AS_ROOT := $(if $(filter 0,$(shell id -u)),,sudo --preserve-env=PYTEST_ARGS)

test: setup-dev
	$(AS_ROOT) .venv/bin/python -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

lint: setup-dev
	.venv/bin/ruff check dsec_cli tests benchmarks
	.venv/bin/mypy dsec_cli

bench: setup-dev
	.venv/bin/python -m benchmarks $(BENCH_ARGS)
