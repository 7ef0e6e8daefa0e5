# The two commands of the README on a fresh Debian 12 / Ubuntu machine:
#   make demo    set up, then `shardfs demo`
#   make test    set up, then `python -m pytest` (what CI runs, after `make lint`)
# Each does only what is missing: a second run checks and goes straight to the command.

# Debian packages the daemon, the demo and the tests need. README's `apt-get install -y` line
# ("Set up, the long way") lists the same, in this order: tests/test_docs.py checks.
APT_PACKAGES := fuse3 libfuse3-dev linux-libc-dev pkg-config nginx-light libnginx-mod-http-echo attr systemd zstd lz4 python3-venv python3-dev gcc zip unzip libarchive-tools 7zip tmux openssl
# The pyproject.toml extras installed into the venv.
EXTRAS := torch,test
# The extras take ranges; CI installs and tests this one pinned pair (empty: let pip choose).
PIP_PINS := torch==2.14.1 torchvision==0.29.1

PYTHON ?= python3
VENV := .venv
# Arguments for pytest: `make test PYTEST_ARGS='tests/test_tar.py -x'` (PYTEST_ADDOPTS works too).
PYTEST_ARGS ?=

# The venv is rebuilt from these: a change to any of them reinstalls the project.
INSTALL_INPUTS := pyproject.toml setup.py shardfs/fuse/_shim.c shardfs/fuse/_shim_meta.c \
	shardfs/fuse/_shim_arena.c shardfs/fuse/_shim_reader.c shardfs/sources/_bodysplice.c Makefile
STAMP := $(VENV)/.shardfs-installed

SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help setup apt demo test lint

help:
	@echo "make demo    set up what is missing, then run 'shardfs demo' (loopback nginx, nothing else to prepare)"
	@echo "make test    set up what is missing, then run the test suite (python -m pytest; PYTEST_ARGS=...)"
	@echo "make setup   only the set-up: Debian packages, $(VENV), the project with extras [$(EXTRAS)]"
	@echo "make lint    ruff check . (through $(VENV))"

setup: apt $(STAMP)

# Installs the missing Debian packages as root or with sudo that needs no password; otherwise
# stops with the line to run. Checked on every run (dpkg-query, well under a second). Waits for
# another apt/dpkg run to finish (unattended upgrades on a fresh machine) rather than failing.
apt:
	@missing=(); \
	for pkg in $(APT_PACKAGES); do \
	  [ "$$(dpkg-query -W -f='$${Status}' "$$pkg" 2>/dev/null)" = "install ok installed" ] || missing+=("$$pkg"); \
	done; \
	if [ $${#missing[@]} -eq 0 ]; then exit 0; fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo=(); \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); \
	else \
	  echo "setup: missing Debian packages: $${missing[*]}"; \
	  echo "setup: run this as root (or with sudo), then run make again:"; \
	  echo "  apt-get install -y $${missing[*]}"; \
	  exit 1; \
	fi; \
	echo "setup: apt-get install -y $${missing[*]}"; \
	"$${sudo[@]}" apt-get update -qq && \
	"$${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  -o DPkg::Lock::Timeout=300 "$${missing[@]}" >/dev/null

$(VENV)/bin/python: | apt
	@echo "setup: creating $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip

$(STAMP): $(VENV)/bin/python $(INSTALL_INPUTS) | apt
	@echo "setup: installing the project into $(VENV) with [$(EXTRAS)] $(PIP_PINS)"
	$(VENV)/bin/python -m pip install -q -e '.[$(EXTRAS)]' $(PIP_PINS)
	@touch $@

demo: setup
	. $(VENV)/bin/activate && shardfs demo

# pytest exits 5 when it collected nothing (a narrowing PYTEST_ADDOPTS, say): no failure.
test: setup
	@echo "python -m pytest $(PYTEST_ARGS)"
	@. $(VENV)/bin/activate && { python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; exit 0; fi; exit $$rc; }

lint: setup
	. $(VENV)/bin/activate && ruff check .
