#!/usr/bin/env bash
# Run jaxtrain on every worker of a TPU VM pod slice (the same command on all workers; JAX finds its peers
# from the TPU metadata, so no coordinator flags are needed).
#
# Needs: gcloud with access to the project; a TPU VM slice (e.g. v5p-128: 64 chips) whose workers can read the code (a
# git checkout in the same path on every worker, or the repo copied there first) and the data / checkpoint
# bucket. Each worker runs tools/launch/tpu_worker.sh there: it installs jaxtrain (the tpu extra) and the clients of
# the object stores the config names (gcsfs for gs://, s3fs for s3://), then trains. The run's workdir should be a
# gs:// path so that every worker writes the same checkpoints:
#
#   TPU_NAME=my-v5p ZONE=us-east5-a PROJECT=my-proj CONFIG=configs/llama3_8b.py \
#   WORKDIR=gs://my-bucket/runs/llama3-8b tools/launch/tpu_vm.sh --config.mesh.fsdp=-1
#
# Extra arguments are passed to jaxtrain.main. Restarting the same command resumes from the newest checkpoint.
# Restarts (exit codes: docs/operations.md): every worker reports its exit code; when one reports 75 (stopped
# early for a cause a restart cures: a maintenance event, a lost peer, a hang), a death by a signal, or none reports
# at all (the session or the hosts went away), and none reports 1 (a bug), 2 (a user mistake), 3 (restarts
# exhausted) or 130 (interrupted), every worker runs again, at most MAX_RESTARTS times in all and at most
# distributed.max_restarts_per_hour times in any hour (the config's value, which the workers report): one more
# within the hour ends it with exit 3. The script exits 0 when the workers report 0 (done), else with their code.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${PROJECT:?set PROJECT}"
: "${CONFIG:=configs/llama3_8b.py}" "${WORKDIR:?set WORKDIR (a gs:// path)}" "${REPO_DIR:=~/jaxtrain}"

args=""  # jaxtrain.main's arguments, quoted for the workers' shell
for arg in "--config=$CONFIG" "--config.workdir=$WORKDIR" "$@"; do args+=" $(printf '%q' "$arg")"; done

output=$(mktemp)
trap 'rm -f "$output"' EXIT
restarted=()  # when this script ran the workers again (seconds since the epoch)
for ((restart = 0; ; restart++)); do
  # Each worker installs jaxtrain and the store clients the config needs, trains, and reports its exit code.
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all \
    --command="cd $REPO_DIR && bash tools/launch/tpu_worker.sh$args" 2>&1 | tee "$output" || true
  codes=$({ grep -o 'jaxtrain-exit-code=[0-9]*' "$output" || true; } | cut -d= -f2 | sort -un | tr '\n' ' ')
  reported=$(grep -c 'jaxtrain-exit-code=' "$output" || true)
  echo "jaxtrain exit codes of the workers: ${codes:-none}" >&2
  case " $codes " in
    *" 1 "* | *" 2 "* | *" 3 "* | *" 130 "*) exit "$(echo $codes | tr ' ' '\n' | grep -E '^(1|2|3|130)$' | head -1)" ;;
  esac
  if [ "$codes" = "0 " ]; then
    exit 0  # every worker reached train.steps
  fi
  if [ "$restart" -ge "${MAX_RESTARTS:-100}" ]; then
    echo "jaxtrain: $restart restarts, giving up" >&2
    exit 75
  fi
  budget=$({ grep -o 'jaxtrain-restart-budget=[0-9]*' "$output" || true; } | head -1 | cut -d= -f2)
  budget=${budget:-6}  # no worker reported it: the default
  now=$(date +%s)
  recent=()
  for t in ${restarted[@]+"${restarted[@]}"}; do
    if [ $((now - t)) -lt 3600 ]; then recent+=("$t"); fi
  done
  restarted=(${recent[@]+"${recent[@]}"})
  if [ "$budget" -gt 0 ] && [ "${#restarted[@]}" -ge "$budget" ]; then
    echo "jaxtrain: stopped: the workers stopped restartably again after ${#restarted[@]} restarts in the last" \
         "hour, the most distributed.max_restarts_per_hour=$budget allows: a restart does not cure this (exit 3)" >&2
    exit 3
  fi
  restarted+=("$now")
  echo "restarting every worker (restart $((restart + 1)); $reported worker(s) reported)" >&2
done
