PYTHON ?= python3

.PHONY: test test-all run

test:
	$(PYTHON) -m unittest -v test_boris

# Run the suite on every Python 3.8-3.13 that pyenv knows (skips the ones absent).
test-all:
	@set -e; found=0; \
	for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(8|9|1[0-3])\.' ); do \
		found=1; echo "=== Python $$v"; PYENV_VERSION=$$v python3 -m unittest test_boris 2>&1 | tail -n 3; \
		PYENV_VERSION=$$v python3 -m unittest -q test_boris >/dev/null 2>&1 || { echo "FAILED on $$v"; exit 1; }; \
	done; \
	if [ $$found = 0 ]; then $(PYTHON) -m unittest test_boris; fi

run:
	$(PYTHON) boris.py
