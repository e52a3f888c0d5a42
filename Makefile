# Chorus task runner. Two commands do all of the set-up on a fresh machine:
#   make demo   - start a headless ComfyUI with the pack and the built-in tiny Wan2.1-I2V model,
#                 run an I2V generation through the HTTP API and print what happened
#   make test   - run the whole test suite (it prints its parts and their times first)
#   make test-fast - the CPU unit tests only, for the edit-run loop
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.chorus-setup
TORCH  ?= torch==2.14.1 torchvision==0.29.1
# The newest ComfyUI frontend, next to the 1.27.10 that ComfyUI 0.3.64 pins: the browser test
# serves it with main.py --front-end-root.
FRONTEND_NEW := 1.58.1
FRONTEND_NEW_STAMP := $(VENV)/frontend-$(FRONTEND_NEW)/.chorus-installed
# The current ComfyUI release the suite also runs against (the locator's CURRENT_VERSION). Its own
# requirements (comfy-kitchen, comfy-aimdo, its frontend) go into a second venv inside the first that
# sees the first one's packages through a .pth file, so torch is installed once.
COMFYUI_CURRENT := 0.19.3
VENV_CURRENT := $(VENV)/comfyui-$(COMFYUI_CURRENT)
VPY_CURRENT := $(VENV_CURRENT)/bin/python
CURRENT_STAMP := $(VENV_CURRENT)/.chorus-setup
# comfy-cli (and the ruff its validator runs), in a venv of its own: its pinned dependencies stay out
# of ComfyUI's. The registry tests run its pre-publish check and its archive builder.
VENV_COMFY_CLI := $(VENV)/comfy-cli
COMFY_CLI_STAMP := $(VENV_COMFY_CLI)/.chorus-setup

.PHONY: setup test test-fast demo clean browser postgres

setup: $(STAMP) $(FRONTEND_NEW_STAMP) $(CURRENT_STAMP) $(COMFY_CLI_STAMP)

# ComfyUI is found (or cloned) before torch is installed: without it nothing here can run,
# and torch is a multi-GB download. The locator needs only the standard library.
$(STAMP): requirements.txt tests/requirements.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m chorus_core.comfy.comfyui_locator --write-requirements $(VENV)/comfyui-requirements.txt
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -r $(VENV)/comfyui-requirements.txt -r requirements.txt -r tests/requirements.txt
	touch $(STAMP)

$(CURRENT_STAMP): $(STAMP)
	$(PYTHON) -m venv $(VENV_CURRENT)
	$(VPY) -c 'import site; print(site.getsitepackages()[0])' > \
	  "$$($(VPY_CURRENT) -c 'import site; print(site.getsitepackages()[0])')/chorus_base_venv.pth"
	CHORUS_COMFYUI_VERSION=$(COMFYUI_CURRENT) $(VPY) -m chorus_core.comfy.comfyui_locator \
	  --write-requirements $(VENV_CURRENT)/comfyui-requirements.txt
	$(VPY_CURRENT) -m pip install -q -r $(VENV_CURRENT)/comfyui-requirements.txt
	touch $@

$(COMFY_CLI_STAMP): | $(STAMP)
	$(PYTHON) -m venv $(VENV_COMFY_CLI)
	$(VENV_COMFY_CLI)/bin/python -m pip install -q comfy-cli ruff
	touch $@

# Order-only on the venv: re-creating the venv's packages does not download the frontend again.
$(FRONTEND_NEW_STAMP): | $(STAMP)
	rm -rf $(VENV)/frontend-$(FRONTEND_NEW)
	$(VPY) -m pip install -q --no-deps --target $(VENV)/frontend-$(FRONTEND_NEW) comfyui-frontend-package==$(FRONTEND_NEW)
	touch $@

# Debian's Chromium and its driver, for the browser test of the web extension (needs root to install).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)

# Debian's PostgreSQL server, for the PostgreSQL mask bank tests (needs root to install). The
# tests start their own throwaway cluster from these binaries on loopback, under a temporary
# folder, and remove it at the end; the package's own cluster is not used.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql)

# CHORUS_REQUIRE_POSTGRES=1: a missing server fails the PostgreSQL bank tests instead of skipping them.
# The whole suite on the oldest supported ComfyUI, then every test that needs ComfyUI (in process
# and end to end; the browser test stays on the first run) again on the current release.
# Times measured 2026-12-06 by a fresh-clone .ci/run on an otherwise idle 2-core Intel Xeon:
# docs/development.md#tests says how each was taken.
test: setup browser postgres
	@echo "make test: (1) the whole suite on ComfyUI 0.3.64 (CPU unit tests, in-process ComfyUI, real ComfyUI servers, the browser on two frontends, the PostgreSQL bank): 13.2 min on 2 idle cores; (2) every ComfyUI test again on $(COMFYUI_CURRENT): 8.3 min. A fresh clone with set-up: about 28 min (measured 2026-12-06)."
	CHORUS_REQUIRE_POSTGRES=1 CHORUS_COMFY_CLI=$(abspath $(VENV_COMFY_CLI))/bin/comfy $(VPY) -m pytest tests
	CHORUS_COMFYUI_VERSION=$(COMFYUI_CURRENT) CHORUS_REQUIRE_POSTGRES=1 \
	  $(VPY_CURRENT) -m pytest -m "comfy and not browser" tests

# The CPU unit tests: no ComfyUI, server, browser or PostgreSQL, and not the benchmark tools'
# tests. 468 tests, 2.3 min of CPU (user + sys; 4.7 min wall on the shared 2 cores).
TEST_FAST := -m "not comfy and not e2e and not browser" -k "not postgres" \
  --ignore=tests/test_demo.py --ignore=tests/test_bank_postgres.py --ignore=tests/test_bench_few_step.py
test-fast: setup
	@echo "make test-fast: the CPU unit tests (no ComfyUI, server, browser or PostgreSQL), 2.3 min of CPU on 2 cores; make test runs everything."
	$(VPY) -m pytest -q $(TEST_FAST) tests

demo: setup
	$(VPY) tests/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
