PYTHON ?= python3

.PHONY: test test-all test-darwin run lint

test:
	$(PYTHON) -W error::ResourceWarning test_boris.py -v

# Run the suite on every Python 3.8-3.15 found: pyenv's, and python3.14/python3.15 on PATH
# (../shared/bench/newpython.sh installs those two). Fails when any of them fails.
test-all:
	@found=0; bad=""; log=$$(mktemp); \
	for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(8|9|1[0-5])\.' ); do \
		found=1; echo "=== Python $$v"; \
		PYENV_VERSION=$$v python3 -W error::ResourceWarning test_boris.py >"$$log" 2>&1; rc=$$?; \
		tail -n 3 "$$log"; [ $$rc = 0 ] || { grep -E '^(FAIL|ERROR):' "$$log"; bad="$$bad $$v"; }; \
	done; \
	for py in python3.14 python3.15; do \
		command -v $$py >/dev/null 2>&1 || continue; \
		found=1; echo "=== $$($$py --version)"; \
		$$py -W error::ResourceWarning test_boris.py >"$$log" 2>&1; rc=$$?; \
		tail -n 3 "$$log"; [ $$rc = 0 ] || { grep -E '^(FAIL|ERROR):' "$$log"; bad="$$bad $$py"; }; \
	done; rm -f "$$log"; \
	if [ $$found = 0 ]; then $(PYTHON) -W error::ResourceWarning test_boris.py || exit 1; fi; \
	if [ -n "$$bad" ]; then echo "FAILED on:$$bad"; exit 1; fi

# The suite macOS-shaped on Linux: a throwaway venv whose .pth, run by every Python it starts
# (not the helpers: -S), removes Linux-only calls from os and sets sys.platform to "darwin"
# (after loading what the standard library would then look for: _scproxy, sysconfig's data).
DARWIN ?= /tmp/boris-darwin-venv
test-darwin:
	rm -rf $(DARWIN) && $(PYTHON) -m venv --without-pip $(DARWIN)
	echo "import os, sys; [delattr(os, n) for n in ('O_TMPFILE', 'sched_getaffinity', 'pidfd_open'," \
	  "'memfd_create', 'eventfd', 'copy_file_range', 'splice') if hasattr(os, n)];" \
	  "import sysconfig, urllib.request; sysconfig.get_config_vars(); sys.platform = 'darwin'" \
	  > $$($(DARWIN)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/darwin.pth
	$(DARWIN)/bin/python -W error::ResourceWarning test_boris.py -v

run:
	$(PYTHON) boris.py

# pyflakes over both files when it is importable; never a dependency (use a throwaway venv).
lint:
	@if $(PYTHON) -c "import pyflakes" 2>/dev/null; then $(PYTHON) -m pyflakes boris.py test_boris.py && echo "pyflakes: clean"; \
	else echo "pyflakes is not installed for $(PYTHON); try: python3 -m venv /tmp/lint && /tmp/lint/bin/pip install pyflakes && make lint PYTHON=/tmp/lint/bin/python"; fi
