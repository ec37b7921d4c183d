# Set-up and entry points. `make demo` and `make test` create .venv themselves.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: sglang-check demo test test-pure lint typecheck check bench venv clean sglang sglang-server sglang-clean sanitize

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py hicache_obs/_copy.c hicache_obs/_logcore.c hicache_obs/_slots.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned, so that nothing else can pull a newer (CUDA) build
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-obs demo $(DEMO_ARGS)

# the suite in $(VENV), then the SGLang tests under each installed release (make sglang);
# in CI (CI=true) a release that is not installed is a failure, not a skip
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)
	@for r in $(SGLANG_RELEASES); do \
	  if [ -f $(SGLANG_DIR)/$$r/.installed ]; then \
	    echo "== SGLang $$r: $(SGLANG_TESTS)"; \
	    server=0; case " $(SGLANG_SERVER_RELEASES) " in *" $$r "*) [ "$$CI" = true ] && server=1;; esac; \
	    HICACHE_REQUIRE_SGLANG=1 HICACHE_REQUIRE_SGLANG_SERVER=$$server $(SGLANG_DIR)/$$r/bin/python -m pytest -q -p no:cacheprovider \
	      $(SGLANG_TESTS) --ignore=$(SGLANG_TESTS)/test_kernels.py $(PYTEST_ARGS) || exit 1; \
	  elif [ "$$CI" = true ]; then \
	    echo "SGLang $$r is not installed: run make sglang first" >&2; exit 1; \
	  else \
	    echo "== SGLang $$r is not installed: its tests are skipped (make sglang installs it)"; \
	  fi; \
	done

# the suite in $(VENV) with every compiled piece replaced by its pure-Python twin
# (hicache_obs/_native.py; HICACHE_OBS_NO_EXTENSIONS=1): what an install without a C
# compiler runs. The SGLang releases are left out (their tests reach the same seams).
test-pure: $(STAMP)
	HICACHE_OBS_REQUIRE_EXTENSIONS= HICACHE_OBS_NO_EXTENSIONS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	$(VENV)/bin/hicache-obs bench

clean:
	rm -rf $(VENV) hicache-demo build .pytest_cache .mypy_cache .ruff_cache

# SGLang test environments, for tests/integrations/sglang only: one per release in
# SGLANG_RELEASES, each a small venv at $(SGLANG_DIR)/<release>/ (its python:
# $(SGLANG_DIR)/<release>/bin/python) layered over $(VENV). A .pth file appends $(VENV)'s
# site-packages (running its .pth files too, so the editable hicache-obs is found), so torch,
# hicache-obs, pytest and hypothesis come from $(VENV) and only the release's pinned set is
# installed, with --no-deps: nothing can pull in another torch. The .pth is written after pip
# has run, so pip sees an empty venv and installs every pin. A changed pin file rebuilds that
# release from scratch; an unchanged one is left alone (stamp file). SGLANG_PIP_ARGS: --no-compile,
# as byte-compiling all of a release costs 30-45 s at install and the tests import a fraction of it:
# instead the check at the end imports what the tests import, writing the bytecode of just that
# (even where PYTHONDONTWRITEBYTECODE is set): every later SGLang import is then ~10 s faster.
SGLANG_RELEASES ?= 0.5.10 0.5.11 0.5.12 0.5.13 0.5.23
SGLANG_DIR ?= .sglang
SGLANG_REQS := tests/integrations/sglang/requirements
SGLANG_PTH := _hicache_obs_main_venv.pth
SGLANG_TESTS := tests/integrations/sglang
SGLANG_PIP_ARGS ?= --no-compile
# what a release's install imports at its end: the controller, and the hybrid trees the tests build
SGLANG_IMPORT_CHECK := 'from hicache_obs.lab.sglang.harness import prepare; prepare(); import sglang.srt.managers.cache_controller; from hicache_obs.lab.sglang.tree import hybrid_trees; print("hybrid trees:", hybrid_trees())'

sglang: $(foreach r,$(SGLANG_RELEASES),$(SGLANG_DIR)/$(r)/.installed)

$(SGLANG_DIR)/%/.installed: $(SGLANG_REQS)/sglang-%.txt | $(STAMP)
	rm -rf $(SGLANG_DIR)/$*
	$(PY) -m venv --without-pip $(SGLANG_DIR)/$*
	$(PIP) --python $(SGLANG_DIR)/$*/bin/python install -q --no-deps --only-binary=:all: $(SGLANG_PIP_ARGS) -r $<
	main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  rel=$$($(SGLANG_DIR)/$*/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  echo "import site; site.addsitedir('$$main')" > "$$rel/$(SGLANG_PTH)"
	# torch must come from $(VENV); sglang itself is only located here, not imported (importing it
	# needs the torchvision stand-in that the tests install)
	$(SGLANG_DIR)/$*/bin/python -c 'import sys, importlib.metadata as md, importlib.util as u, torch, hicache_obs, pytest, hypothesis; \
	  assert torch.__file__.startswith(sys.argv[1]), torch.__file__; \
	  assert md.version("sglang") == sys.argv[2] and u.find_spec("sglang").origin.startswith(sys.prefix); \
	  print("sglang", sys.argv[2], "in", sys.prefix, "with torch", torch.__version__)' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" $*
	# import what the tests import, once: its bytecode is written now, and the stand-ins are proven
	env -u PYTHONDONTWRITEBYTECODE $(SGLANG_DIR)/$*/bin/python -W ignore -c \
	  $(SGLANG_IMPORT_CHECK)
	touch $@

# What SGLang's HTTP server needs on top of a release's set, for the real-server tests
# (tests/integrations/sglang/test_real_server.py): $(SGLANG_REQS)/server-<release>.txt,
# installed with --no-deps into that release's venv. In CI (CI=true) the real-server tests
# fail rather than skip on these releases when it is missing. The import check below also
# proves the CPU stand-ins (hicache_obs/lab/sglang/cpu_server.py) load there.
SGLANG_SERVER_RELEASES ?= 0.5.10 0.5.11 0.5.23

sglang-server: $(foreach r,$(SGLANG_SERVER_RELEASES),$(SGLANG_DIR)/$(r)/.server-installed)

$(SGLANG_DIR)/%/.server-installed: $(SGLANG_REQS)/server-%.txt $(SGLANG_DIR)/%/.installed
	$(PIP) --python $(SGLANG_DIR)/$*/bin/python install -q --no-deps --only-binary=:all: $(SGLANG_PIP_ARGS) -r $<
	env -u PYTHONDONTWRITEBYTECODE SGLANG_USE_CPU_ENGINE=1 HICACHE_OBS_SGLANG_CPU=1 \
	  PYTHONPATH=hicache_obs/lab/sglang/_cpu_boot $(SGLANG_DIR)/$*/bin/python -W ignore -c \
	  'import sglang.srt.entrypoints.http_server, sglang.srt.models.llama, sglang.srt.models.lfm2, sglang.srt.models.nemotron_h; print("sglang server imports")'
	touch $@

# Any other SGLang release, one at a time, for a maintainer: `make sglang-check RELEASE=0.5.18`
# installs it into $(SGLANG_DIR)/check-<release>/ over the pinned set of CHECK_BASE (the same
# packages, only sglang replaced) and runs the SGLang tests there (the real-server tests skip:
# no server packages). A release that needs other packages fails at its import check, naming
# the module: add them with CHECK_EXTRA="name==version ...". To pin a release for good, give it
# its own requirements file and add it to SGLANG_RELEASES.
RELEASE ?=
CHECK_BASE ?= 0.5.23
CHECK_EXTRA ?=

sglang-check: | $(STAMP)
	@test -n "$(RELEASE)" || { echo "usage: make sglang-check RELEASE=0.5.18 [CHECK_BASE=0.5.23]" >&2; exit 2; }
	rm -rf $(SGLANG_DIR)/check-$(RELEASE)
	$(PY) -m venv --without-pip $(SGLANG_DIR)/check-$(RELEASE)
	sed 's/^sglang==.*/sglang==$(RELEASE)/' $(SGLANG_REQS)/sglang-$(CHECK_BASE).txt > $(SGLANG_DIR)/check-$(RELEASE)/requirements.txt
	for pin in $(CHECK_EXTRA); do echo "$$pin" >> $(SGLANG_DIR)/check-$(RELEASE)/requirements.txt; done
	$(PIP) --python $(SGLANG_DIR)/check-$(RELEASE)/bin/python install -q --no-deps --only-binary=:all: $(SGLANG_PIP_ARGS) \
	  -r $(SGLANG_DIR)/check-$(RELEASE)/requirements.txt
	main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  rel=$$($(SGLANG_DIR)/check-$(RELEASE)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  echo "import site; site.addsitedir('$$main')" > "$$rel/$(SGLANG_PTH)"
	$(SGLANG_DIR)/check-$(RELEASE)/bin/python -W ignore -c \
	  $(SGLANG_IMPORT_CHECK)
	HICACHE_REQUIRE_SGLANG=1 $(SGLANG_DIR)/check-$(RELEASE)/bin/python -m pytest -q -p no:cacheprovider \
	  $(SGLANG_TESTS) --ignore=$(SGLANG_TESTS)/test_kernels.py $(PYTEST_ARGS)

sglang-clean:
	rm -rf $(SGLANG_DIR)

# The three C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer into
# $(SANITIZE_DIR) (a copy of the package beside them; the in-place build is left alone),
# then the tests that reach them run against that build: tests/native (hostile cases and
# the fuzz probes, whose child interpreters inherit the sanitizers) and the C-facing tests.
# The sanitizer runtimes are preloaded into the non-sanitized interpreter; CPython's own
# allocations go through malloc (PYTHONMALLOC=malloc) so that an overrun of an object is
# seen; leaks are not reported (CPython keeps objects until exit by design); any
# UndefinedBehaviorSanitizer report stops the process. python -P: the tree in the working
# directory is not imported, only $(SANITIZE_DIR)'s.
SANITIZE_DIR ?= build/sanitize
SANITIZE_CFLAGS ?= -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
SANITIZE_TESTS ?= tests/native tests/core/test_native_copy.py tests/events/test_slot_map.py tests/events/test_log.py \
	tests/events/test_handoff.py
CC ?= cc

sanitize: $(STAMP)
	rm -rf $(SANITIZE_DIR)
	mkdir -p $(SANITIZE_DIR)
	cp -r hicache_obs $(SANITIZE_DIR)/
	find $(SANITIZE_DIR)/hicache_obs \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
	inc=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])') && \
	  suffix=$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') && \
	  for m in _copy _logcore _slots; do \
	    $(CC) -shared -fPIC $(SANITIZE_CFLAGS) -I"$$inc" hicache_obs/$$m.c -o $(SANITIZE_DIR)/hicache_obs/$$m$$suffix || exit 1; \
	  done
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONMALLOC=malloc \
	  PYTHONPATH=$(SANITIZE_DIR):$(CURDIR) \
	  $(PY) -P -c 'import sys, hicache_obs._copy as c; assert c.__file__.startswith(sys.argv[1]), c.__file__; \
	    print("sanitized build:", c.__file__)' "$(abspath $(SANITIZE_DIR))"
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONMALLOC=malloc \
	  PYTHONPATH=$(SANITIZE_DIR):$(CURDIR) \
	  $(PY) -P -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS) $(PYTEST_ARGS)
