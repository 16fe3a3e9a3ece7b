# GPU image for clusters. NVIDIA's PyTorch container already ships CUDA, cuDNN, torch and DALI.
#   docker build -t ssd_lightning .
#   docker run --gpus all --ipc=host -v /data/coco:/coco -v /data/runs:/workspace/ssd_lightning/outputs \
#       ssd_lightning python train.py experiment=ssd300_fp16_8gpu data.root=/coco
# (run directories land in /data/runs on the host: docs/distributed.md, "Containers")
# COCO itself: scripts/download_coco.sh /data/coco on the host (or inside the image, into the mounted path).
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /workspace/ssd_lightning
ENV PYTHONUNBUFFERED=1

# Dependencies first (cached layer); torch and DALI come from the base image. Its DALI is neither of the
# two lines `make test` runs (1.34, 2.4+); ssd_lightning/data/dali_compat.py detects what it has.
COPY pyproject.toml README.md ./
COPY ssd_lightning ./ssd_lightning
RUN pip install --no-cache-dir -e .

COPY configs ./configs
COPY scripts ./scripts
COPY train.py predict.py ./

CMD ["python", "train.py", "--help"]
