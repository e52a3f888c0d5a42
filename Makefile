# Chorus task runner. Two commands do all of the set-up on a fresh machine:
#   make demo   - start a headless ComfyUI with the pack and the built-in tiny Wan2.1-I2V model,
#                 run an I2V generation through the HTTP API and print what happened
#   make test   - run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.chorus-setup
TORCH  ?= torch==2.14.1 torchvision==0.29.1

.PHONY: setup test demo clean browser

setup: $(STAMP)

$(STAMP): requirements.txt tests/requirements.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m chorus_core.comfyui_locator --write-requirements $(VENV)/comfyui-requirements.txt
	$(VPY) -m pip install -q -r $(VENV)/comfyui-requirements.txt -r requirements.txt -r tests/requirements.txt
	touch $(STAMP)

# Debian's Chromium and its driver, for the browser test of the web extension (needs root to install).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)

test: setup browser
	$(VPY) -m pytest tests

demo: setup
	$(VPY) tests/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
