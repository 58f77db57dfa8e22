# Two entry points that work on a fresh machine:
#   make demo   - set up .venv and generate one image with the built-in default model
#   make test   - set up .venv and run the test suite (CPU; Triton kernels in the interpreter; one pytest-xdist
#                 worker per core, each test file on one worker)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines take the CPU build of torch that lies on local disk (and the Triton whose interpreter CI uses);
# a CUDA machine keeps pip's default torch, which brings its own Triton.
TORCH_PIN := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0 triton==3.6.0")

.PHONY: setup demo test gpu clean

$(BIN)/.installed: pyproject.toml .ci/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -c .ci/constraints.txt -e ".[test,server,bench]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/sdfast txt2img "a photo of a cat" --seed 0 --out out/demo.png

test: setup
	$(BIN)/python -m pytest -q -n auto --dist loadfile

clean:
	rm -rf $(VENV) out
