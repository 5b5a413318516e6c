PYTHON ?= python3

.PHONY: test test-all run lint

test:
	$(PYTHON) -W error::ResourceWarning -m unittest -v test_boris

# Run the suite on every Python 3.8-3.13 that pyenv knows (skips the ones absent).
test-all:
	@found=0; bad=""; log=$$(mktemp); \
	for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(8|9|1[0-3])\.' ); do \
		found=1; echo "=== Python $$v"; \
		PYENV_VERSION=$$v python3 -W error::ResourceWarning -m unittest test_boris >"$$log" 2>&1; rc=$$?; \
		tail -n 3 "$$log"; [ $$rc = 0 ] || bad="$$bad $$v"; \
	done; rm -f "$$log"; \
	if [ $$found = 0 ]; then $(PYTHON) -m unittest test_boris || exit 1; fi; \
	if [ -n "$$bad" ]; then echo "FAILED on:$$bad"; exit 1; fi

run:
	$(PYTHON) boris.py

# pyflakes over both files when it is importable; never a dependency (use a throwaway venv).
lint:
	@if $(PYTHON) -c "import pyflakes" 2>/dev/null; then $(PYTHON) -m pyflakes boris.py test_boris.py && echo "pyflakes: clean"; \
	else echo "pyflakes is not installed for $(PYTHON); try: python3 -m venv /tmp/lint && /tmp/lint/bin/pip install pyflakes && make lint PYTHON=/tmp/lint/bin/python"; fi
