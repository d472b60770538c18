# syntax=docker/dockerfile:1
# The sdforge image: this repo at /opt/sdforge (a git checkout: DVC needs one) and its venv, for the flows' pods
# (prefect.yaml's gpu-pods block) and the training pods (sdforge/cluster). `make image` builds it; nothing else
# needs it: the demo and the tests run from `make venv`.
#
# No credentials, in any layer: S3 access comes from the pod's service account (IRSA / workload identity), MLflow's
# address is a URL passed at run time. No ENV or ARG holds a key, token or password; .dockerignore keeps .env files,
# ~/.aws-style folders, keys, .dvc/config.local, Prefect's profiles and git's config/logs (remote URLs can embed a
# token) out of the build context, and the `src` stage below rewrites git's config all the same.
#
# Base image and torch: torch is the Makefile's pin (TORCH := torch==2.13.0) as its CUDA 12.8 build, from
# PyTorch's cu128 index (locally the same pin resolves to a CPU wheel). The wheel brings its own CUDA runtime,
# cuDNN and NCCL (nvidia-* wheels), so the base only has to match its CUDA version and carry what the NVIDIA
# container runtime expects: nvidia/cuda's `runtime` flavour of the same CUDA (not `cudnn-runtime`, whose cuDNN the
# wheel would duplicate, nor `devel`: nothing is compiled). CUDA 12.8 has kernels for Ampere, Hopper (H100/H200)
# and Blackwell and wants a driver >= 570 (the H200 sessions' was 580). Ubuntu 24.04's own Python 3.12 (pyproject:
# >=3.11,<3.13) builds the venv.
# Another CUDA: change both, e.g. --build-arg CUDA_VERSION=13.0.2 --build-arg TORCH_CUDA=cu130 (tests/test_image.py
# checks that they agree).
ARG CUDA_VERSION=12.8.1
ARG TORCH_CUDA=cu128

# ---- src: the build context as a git checkout, with a fresh git config ----
# The repo's .git is copied (DVC runs in a git repo, and `git rev-parse HEAD` in the image is GIT_SHA), minus its
# config, hooks, reflogs and FETCH_HEAD (.dockerignore), which may name remotes with credentials; `git init`
# writes a default config. Only this stage's result is copied on, so nothing removed here is in the image.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS src
RUN apt-get update \
 && apt-get install -y --no-install-recommends git \
 && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN cd /src \
 && rm -rf .git/config .git/hooks .git/logs .git/FETCH_HEAD .git/remotes .git/branches \
 && git init -q \
 && git rev-parse --verify -q HEAD >/dev/null \
 || { echo "the build context's .git is not a repository with a HEAD commit (a worktree's .git file?)" >&2; exit 1; }

# ---- the image ----
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
ARG CUDA_VERSION
ARG TORCH_CUDA
# = the Makefile's TORCH pin and pyproject's (tests/test_image.py checks all three agree)
ARG TORCH_VERSION=2.13.0

# python3 + venv: the interpreter; git: DVC's repo (and MLflow's commit tag); tini: PID 1, forwards SIGTERM to the
# flow or stage (whose own handlers stop training cleanly) and reaps torchrun's workers; libglib: OpenCV.
# uid 1000 is Ubuntu 24.04's `ubuntu` user in the base image: removed, so that `sdforge` gets it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv git ca-certificates tini libglib2.0-0t64 \
 && rm -rf /var/lib/apt/lists/* \
 && git config --system --add safe.directory /opt/sdforge \
 && if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid 1000 --user-group --shell /bin/bash sdforge

WORKDIR /opt/sdforge
ENV VIRTUAL_ENV=/opt/sdforge/.venv \
    PATH=/opt/sdforge/.venv/bin:$PATH

# As `make venv`: torch first and pinned (its own layer: the large one, rebuilt only when the pin changes) ...
RUN python3 -m venv /opt/sdforge/.venv \
 && pip install --no-cache-dir --upgrade pip \
 && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/${TORCH_CUDA} torch==${TORCH_VERSION}

COPY --from=src --chown=sdforge:sdforge /src /opt/sdforge

# ... then the project, editable (the flows run `python -m stages.<stage>` from this checkout), without the test
# extra (its dependencies include the cluster path's prefect-kubernetes and kubernetes); img2dataset and open-clip-torch without their
# deps, and no `dataclasses` backport (it shadows the stdlib inside Prefect). The venv stays root's (a run cannot
# change its own dependencies); the checkout, the work folders and the cache are sdforge's.
RUN pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps img2dataset==1.47.0 open-clip-torch==3.3.0 \
 && if pip show -q dataclasses >/dev/null 2>&1; then pip uninstall -y dataclasses; fi \
 && python -c "import torch, sys; v, c = torch.__version__, torch.version.cuda; \
sys.exit(0 if v.split('+')[0] == '${TORCH_VERSION}' and c and '${CUDA_VERSION}'.startswith(c + '.') \
else f'torch {v} (CUDA {c}) is not ${TORCH_VERSION} for CUDA ${CUDA_VERSION}')" \
 && mkdir -p /cache/huggingface /cache/torch data models checkpoints runs eval evaluations metrics .dvc/cache .dvc/tmp \
 && chown sdforge:sdforge /opt/sdforge \
 && chown -R sdforge:sdforge /cache data models checkpoints runs eval evaluations metrics .dvc

# Run-time settings (no credentials: MLFLOW_TRACKING_URI and the like come from the pod spec). The Makefile's
# analytics switches, not its offline ones: the full config downloads its frozen models into HF_HOME.
ENV HF_HOME=/cache/huggingface \
    TORCH_HOME=/cache/torch \
    SDFORGE_ROOT=/opt/sdforge \
    SDFORGE_PROGRESS=0 \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 \
    DVC_NO_ANALYTICS=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    NO_ALBUMENTATIONS_UPDATE=1 \
    WANDB_MODE=disabled

# Volumes: the model cache (/cache: HF_HOME, TORCH_HOME) and the work dir, i.e. the top folders of the full
# config's paths.* under the checkout (the same mounts the cluster's pods get: sdforge/cluster/manifests.py), and
# DVC's cache. A whole DVC output must never be a mount point — DVC deletes an output folder before it reruns the
# stage, which fails on one (EBUSY) — so the full config keeps prepare_models' output one level down (models/sd).
VOLUME ["/cache", "/opt/sdforge/data", "/opt/sdforge/models", "/opt/sdforge/checkpoints", "/opt/sdforge/runs", \
        "/opt/sdforge/eval", "/opt/sdforge/evaluations", "/opt/sdforge/metrics", "/opt/sdforge/.dvc/cache"]

# Labels last: a build arg invalidates the cache of every RUN after its ARG line (GIT_SHA changes per commit).
ARG GIT_SHA=unknown
# the repo's address (--build-arg SOURCE_URL=https://...); not read from git's remote, which can embed a token
ARG SOURCE_URL=""
LABEL org.opencontainers.image.title="sdforge" \
      org.opencontainers.image.description="Trains Stable Diffusion 1.x from scratch (DVC stages, Prefect flows)" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.base.name="nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04"

USER sdforge
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["bash"]
