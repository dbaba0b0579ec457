# The series in a container: CUDA runtime, Python 3.11, the pinned requirements.txt, the code.
# Build and run it from the repository root (docs/CONTAINER.md):
#
#   docker build -t ddp-series .
#   docker run --rm --gpus all --ipc=host ddp-series torchrun --standalone --nproc_per_node=gpu \
#       02_multigpu/train.py
#   docker run --rm --gpus all --ipc=host -w /home/series/app/05_mingpt ddp-series python main.py
#
# Another build of the pinned torch (another CUDA version, or CPU only) comes from its index:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t ddp-series .
# tests/test_container.py lints this file (hadolint) and checks what it names exists.

# The CUDA runtime base brings the user-space CUDA libraries and the NVIDIA_* variables that the
# NVIDIA container toolkit (docker --gpus, enroot/pyxis, apptainer --nv) reads to mount the
# host's driver. Its CUDA is the one PyPI's torch 2.14.1 is built for (torch.version.cuda 13.0;
# a test keeps the two equal), which needs driver 580 or newer. For an older driver, build with
# an older BASE_IMAGE and a TORCH_INDEX_URL (download.pytorch.org/whl/cuXYZ) of the same CUDA.
ARG BASE_IMAGE=docker.io/nvidia/cuda:13.0.1-runtime-ubuntu22.04
FROM ${BASE_IMAGE}

# The wheel index torch and torchvision come from. PyPI's build bundles its CUDA libraries and
# runs on CPU too.
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.11 from the deadsnakes PPA: Ubuntu 22.04's own python3.11 is an early 3.11.0 build
# (reported to lack sys.get_int_max_str_digits, which torch's compiler calls). The PPA tool is
# removed again; --no-install-recommends and no apt lists kept: a smaller image. apt versions
# are the archive's; the Python packages, which decide the results, are pinned below.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
    && apt-get purge -y --auto-remove software-properties-common gpg-agent \
    && rm -rf /var/lib/apt/lists/*

# A non-root user owns the code and the folder the steps write their snapshots to (made here:
# WORKDIR would make it as root). uid 1000 is the first user of most Linux machines, so files
# it writes to a mounted folder belong to that user on the host; pass
# --user "$(id -u):$(id -g)" to docker run where yours differs.
RUN useradd --create-home --uid 1000 --shell /bin/bash series \
    && install -d -o series -g series /home/series/app \
    && python3.11 -m venv /opt/venv \
    && chown -R series:series /opt/venv
# By number: a runtime can tell that it is not root without reading the image's /etc/passwd.
USER 1000:1000
WORKDIR /home/series/app

# Requirements first, code later: editing the code does not re-run the slow install layer.
# torch and torchvision are installed first from TORCH_INDEX_URL at requirements.txt's pinned
# versions; the second install then finds them satisfied (==2.14.1 accepts 2.14.1+cpu).
COPY --chown=series:series requirements.txt ./
RUN grep -E '^(torch|torchvision)==' requirements.txt > /tmp/torch.txt \
    && pip install --index-url "$TORCH_INDEX_URL" -r /tmp/torch.txt \
    && pip install -r requirements.txt \
    && rm /tmp/torch.txt

# The series itself (.dockerignore keeps out .venv, runs, snapshots and caches).
COPY --chown=series:series 01_single_gpu/ 01_single_gpu/
COPY --chown=series:series 02_multigpu/ 02_multigpu/
COPY --chown=series:series 03_torchrun_fault_tolerance/ 03_torchrun_fault_tolerance/
COPY --chown=series:series 04_multinode/ 04_multinode/
COPY --chown=series:series 05_mingpt/ 05_mingpt/
COPY --chown=series:series slurm_scripts/ slurm_scripts/

# A command given to `docker run IMAGE ...` replaces this one. Step 02 starts one process per
# GPU by itself, or 2 CPU processes where there is none.
CMD ["python", "02_multigpu/train.py"]
