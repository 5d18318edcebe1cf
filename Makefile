# `make bench`: every benchmark in one run (about 38 minutes on 2 shared cores: 26 in its last whole
# run, and the simulator-accuracy bench runs every job five times, each round calibrated afresh,
# since: 14 minutes alone), then
# docs/benchmarks.md (and, on a machine with a CUDA device, docs/benchmarks-gpu.md).
# `make test`: what CI runs. Both set up .venv first.
.PHONY: bench test

bench:
	bash scripts/setup.sh
	PYTHONPATH=. .venv/bin/python bench/run_all.py

test:
	bash .ci/run
