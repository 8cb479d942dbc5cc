#!/usr/bin/env bash
# Run jaxtrain on every worker of a TPU VM pod slice (the same command on all workers; JAX finds its peers
# from the TPU metadata, so no coordinator flags are needed).
#
# Needs: gcloud with access to the project; a TPU VM slice (e.g. v5p-64) whose workers can read the code (a
# git checkout in the same path on every worker, or the repo copied there first) and the data / checkpoint
# bucket. The run's workdir should be a gs:// path so that every worker writes the same checkpoints:
#
#   TPU_NAME=my-v5p ZONE=us-east5-a PROJECT=my-proj CONFIG=configs/llama3_8b.py \
#   WORKDIR=gs://my-bucket/runs/llama3-8b tools/launch/tpu_vm.sh --config.mesh.fsdp=-1
#
# Extra arguments are passed to jaxtrain.main. Restarting the same command resumes from the newest checkpoint.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${PROJECT:?set PROJECT}"
: "${CONFIG:=configs/llama3_8b.py}" "${WORKDIR:?set WORKDIR (a gs:// path)}" "${REPO_DIR:=~/jaxtrain}"

extra=""
for arg in "$@"; do extra+=" $(printf '%q' "$arg")"; done

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all --command="
  set -e
  cd $REPO_DIR
  pip install -q -e '.[tpu]'
  python -m jaxtrain.main --config=$CONFIG --config.workdir=$WORKDIR$extra
"
