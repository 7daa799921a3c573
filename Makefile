# The two commands of the README. Both create .venv when it is missing.
PY := .venv/bin/python

.PHONY: serve test venv
venv:
	@bash scripts/bootstrap

serve: venv
	$(PY) -m cli up $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)
