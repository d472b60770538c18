# sdforge — every entry point. A fresh machine needs only Python 3.11 (or 3.12) and pip.
#
#   make demo         build the venv if needed, run the whole DVC pipeline, print where the results are
#   make demo-recaption  the demo + a source captioned with file names, recaptioned (workspace .demo-recaption/)
#   make demo-controlnet  the demo + a ControlNet phase placing small shapes (workspace .demo-controlnet/)
#   make demo-mmdit   the demo's whole DAG with a tiny MM-DiT (SD3's backbone) instead of the UNet (.demo-mmdit/)
#   make demo-sdxl    a tiny SDXL base taught a new colour by three adapter setups (.demo-sdxl/)
#   make test         ruff + the fast tests (slow, gpu and multi-rank deselected); `make test-ranks`: the multi-rank ones
#   make stack-up     local Prefect server + work pool + deployments + process worker (logs in .stack/)
#   make stack-up-s3  the same + MLflow server (artifacts on S3) + moto's S3 server on loopback (local test)
#   make stack-down   stop the worker (SIGINT first), then MLflow, the server, S3
#   make run-phase PHASE=phase7   run a deployment through the stack and watch it
#   make mlflow-ui    MLflow UI on http://127.0.0.1:5000 over sqlite:///mlflow.db
#   make preflight    the full config's whole DAG on a small sample, real architectures; forecast (~40 min on 2 cores)
#   make image        the CUDA image for the cluster (Dockerfile; IMAGE=registry/sdforge:tag); not needed otherwise
#   make cluster-check   params ready for Kubernetes? every problem by key (docs/CLUSTER.md)
#   make cluster-render  every manifest (work pool, each deployment's pod, each phase's training job) into cluster-manifests/
#   make work-pool       create/update the Prefect Kubernetes work pool `gpu-pods` (deploy/kubernetes/work-pool.json)
#   make cluster-deploy  the deployments of deploy/kubernetes/prefect.yaml on that pool

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
IMG2DATASET := img2dataset==1.47.0
# --no-deps: we read only its CLIP BPE merges file (sdforge/architectures); its deps would pull torchvision.
OPEN_CLIP := open-clip-torch==3.3.0
TORCHAO := torchao==0.18.0
PHASE ?= phase7

# The interpreter the venv is built from: python3.11 if present, else python3 (checked: 3.11 or 3.12).
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3 2>/dev/null)

# Offline switches and local state, for every target and everything they start.
export NO_ALBUMENTATIONS_UPDATE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE := disabled
export PREFECT_HOME := $(CURDIR)/.prefect
export SDFORGE_ROOT := $(CURDIR)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# MLFLOW_TRACKING_URI is left alone: unset, the stages use params.yaml's tracking.mlflow_uri.

.PHONY: help venv demo demo-recaption demo-controlnet demo-mmdit demo-sdxl preflight test test-ranks test-all lint stack-up stack-up-s3 stack-down stack-status run-phase mlflow-ui clean-outputs

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

venv: $(STAMP)

# torch first and pinned (a local CPU wheel here; a looser pin pulls GBs of CUDA wheels), then the
# project, then img2dataset without its deps (its `dataclasses` backport shadows the stdlib and
# breaks Prefect's server; see /work/shared/STACK-NOTES.md).
$(STAMP): pyproject.toml
	@test -x $(PY) || { \
	  test -n "$(PYTHON)" || { echo "need python3.11 (or 3.12) on PATH" >&2; exit 1; }; \
	  $(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' \
	    || { echo "$(PYTHON) is Python $$($(PYTHON) -V 2>&1); need 3.11 or 3.12" >&2; exit 1; }; \
	  echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install --no-deps $(IMG2DATASET)
	$(PY) -m pip install --no-deps $(OPEN_CLIP)
	@if $(PY) -m pip show -q dataclasses >/dev/null 2>&1; then $(PY) -m pip uninstall -y dataclasses; fi
	@touch $@

# The pipeline runs in its own session; Ctrl-C / TERM is forwarded to the whole group
# (a killed `dvc` alone would orphan the running stage). HF_HUB_DISABLE_PROGRESS_BARS: transformers draws a
# "Loading weights" bar for every local model it loads (14 in a demo run); the demo downloads nothing.
demo: venv
	@[ -d .dvc ] || dvc init -q
	@$(PY) -m tools.check_params params.yaml   # before DVC parses it (docs/INPUTS.md)
	@start=$$(date +%s); \
	HF_HUB_DISABLE_PROGRESS_BARS=1 setsid dvc repro & pid=$$!; \
	trap 'echo "stopping pipeline (process group $$pid)"; kill -TERM -- -$$pid 2>/dev/null; wait $$pid' INT TERM; \
	wait $$pid; rc=$$?; trap - INT TERM; \
	echo "pipeline wall time: $$(( $$(date +%s) - start )) s (dvc repro exit $$rc)"; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(PY) -m tools.results

# The demo plus a source captioned with file names, recaptioned (docs/CAPTIONS.md); workspace .demo-recaption/.
# DEMO_RECAPTION_ARGS: e.g. --all (the whole DAG, phase 6 training on the captions)
demo-recaption: venv
	$(PY) -m tools.demo_recaption $(DEMO_RECAPTION_ARGS)

# The demo plus a ControlNet phase on small shapes placed anywhere (docs/CONTROL.md); workspace .demo-controlnet/.
# DEMO_CONTROLNET_ARGS: e.g. --seeds 0,1,2 (the ControlNet phase retrained under each train.seed)
demo-controlnet: venv
	HF_HUB_DISABLE_PROGRESS_BARS=1 $(PY) -m tools.demo_controlnet $(DEMO_CONTROLNET_ARGS)

# The demo's DAG, phases 0-8, with the MM-DiT family (docs/MMDIT.md); workspace .demo-mmdit/ (a rerun resumes).
demo-mmdit: venv
	HF_HUB_DISABLE_PROGRESS_BARS=1 $(PY) -m tools.demo_mmdit $(DEMO_MMDIT_ARGS)

# A tiny SDXL base (phases 0-1) taught "orange" by each adapter setup of issue 60 (docs/SDXL.md); workspace
# .demo-sdxl/. DEMO_SDXL_ARGS: e.g. --seeds 0,1,2 (the adapter phases retrained under each train.seed)
# torchao (setup (c)'s NF4 base) goes to .qlora-site/, on the demo's PYTHONPATH only: in the venv, diffusers would
# import it in every process of every demo (docs/SDXL.md "A quantised base").
demo-sdxl: venv
	@test -d .qlora-site/torchao || $(PY) -m pip install -q --no-deps --target .qlora-site $(TORCHAO)
	HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH=$(CURDIR)/.qlora-site $(PY) -m tools.demo_sdxl $(DEMO_SDXL_ARGS)

# PREFLIGHT_ARGS: e.g. --params my/params.yaml --gpus 8 --price-per-gpu-hour 2.1 (docs/PREFLIGHT.md)
preflight: venv
	$(PY) -m tools.preflight $(PREFLIGHT_ARGS)

lint: venv
	ruff check .

# TEST_WORKERS: pytest-xdist processes (one module per worker, heaviest first: tests/fixtures/suite.py); 0 runs
# the suite in this process. The tests are single-threaded (OMP_NUM_THREADS=1), so 2 fill this 2-core machine.
TEST_WORKERS ?= 2
test: venv lint
	pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25   # the 25 slowest: where the time goes

# The tests that start several training processes at once (torchrun ranks, FSDP, pods, world-size changes): each
# rank imports the stack (~10 s here), so they are the suite's slowest and run apart; .ci/run runs both targets.
test-ranks: venv
	pytest -m 'ranks and not slow and not gpu' -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

test-all: venv lint
	pytest -m 'not gpu'

stack-up: venv
	$(PY) -m tools.stack up

stack-up-s3: venv
	$(PY) -m tools.stack up --with-s3 --mlflow

stack-down:
	@if [ -x $(PY) ]; then $(PY) -m tools.stack down; else echo "no $(VENV): nothing to stop"; fi

stack-status:
	$(PY) -m tools.stack status

run-phase: venv
	$(PY) -m tools.stack run --phase $(PHASE)

mlflow-ui: venv
	$(PY) -m tools.cli tracking-flush
	mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

# The cluster's image (Dockerfile): tagged with the short commit unless IMAGE is given; GIT_SHA becomes its
# org.opencontainers.image.revision label. Needs docker; nothing else depends on it.
IMAGE ?= sdforge:$$(git rev-parse --short HEAD)
.PHONY: image
image:
	docker build -t $(IMAGE) --build-arg GIT_SHA=$$(git rev-parse HEAD) .

# Kubernetes (docs/CLUSTER.md): each runs tools.cluster on params.yaml, which first checks it for the cluster.
.PHONY: cluster-check cluster-render work-pool cluster-deploy
cluster-check: venv
	$(PY) -m tools.cluster check
cluster-render: venv
	$(PY) -m tools.cluster render --out cluster-manifests
work-pool: venv
	$(PY) -m tools.cluster work-pool
cluster-deploy: venv
	$(PY) -m tools.cluster deploy

# Pipeline outputs and local tracking state (DVC's cache in .dvc/cache is kept).
clean-outputs:
	rm -rf data models checkpoints runs eval metrics mlruns mlflow.db mlflow.db.spool
