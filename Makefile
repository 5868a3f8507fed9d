# make demo   - 4-rank CPU training under ft_launcher with an injected crash and hang
# make test   - the test suite (real processes, gloo on CPU)
# make bench  - benchmarks against torchrun and nvidia-resiliency-ext 0.4.1
# make compat - the test suite on the newest torch installable here (not part of CI)
PYTHON ?= python3
VENV := .venv
PEER_VENV := .venv-peer
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# The newest torch the package index offers here; nvrx_core/torch_compat.py lists both.
COMPAT_VENV := .venv-compat
COMPAT_TORCH := torch==2.14.1

# The rest goes in with uv: 12 s here against pip's 43 s (pip resolves and compiles one file
# at a time). pip does it where uv cannot be installed. torch stays with pip, which reads
# this machine's pip configuration (the local CPU wheel).
EXTRAS := .[dev,lightning,nemo-run,report,hf]

.PHONY: venv demo test bench peer compat clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q $(TORCH_PIN)
	$(VENV)/bin/pip install -q uv && \
	  $(VENV)/bin/uv pip install -q --python $(VENV)/bin/python --compile-bytecode -e '$(EXTRAS)' || \
	  $(VENV)/bin/pip install -q -e '$(EXTRAS)'
	touch $@

demo: venv
	$(VENV)/bin/nvrx demo

test: venv
	$(VENV)/bin/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder tests

compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder tests

$(COMPAT_VENV)/.installed: pyproject.toml
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q $(COMPAT_TORCH)
	$(COMPAT_VENV)/bin/pip install -q -e '$(EXTRAS)'
	touch $@

# nvidia-resiliency-ext installs its own `ft_launcher`, so it lives in a venv of its own.
peer: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed:
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -c "import torch" 2>/dev/null || $(PEER_VENV)/bin/pip install -q $(TORCH_PIN)
	# numpy: nvidia-resiliency-ext's checkpointing imports it without declaring it;
	# lightning: its FaultToleranceCallback, the peer of bench/lightning.py
	$(PEER_VENV)/bin/pip install -q nvidia-resiliency-ext==0.4.1 numpy 'lightning>=2.4'
	touch $@

bench: venv peer
	set -e; for f in bench/[a-z]*.py; do echo "== $$f"; $(VENV)/bin/python $$f --peer-python $(PEER_VENV)/bin/python; done

clean:
	rm -rf $(VENV) $(PEER_VENV) $(COMPAT_VENV) build *.egg-info
