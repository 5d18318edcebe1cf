# `make bench`: every benchmark in one run (26 minutes on 2 shared cores in its last run), then
# docs/benchmarks.md (and, on a machine with a CUDA device, docs/benchmarks-gpu.md).
# `make test`: what CI runs. Both set up .venv first.
.PHONY: bench test

bench:
	bash scripts/setup.sh
	PYTHONPATH=. .venv/bin/python bench/run_all.py

test:
	bash .ci/run
