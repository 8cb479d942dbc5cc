#!/usr/bin/env bash
# What tools/launch/tpu_vm.sh runs on every worker of the slice, in the jaxtrain checkout: install jaxtrain with its
# accelerator's extra, then the object-store clients the config's URLs need, then train; and print what the launcher
# reads: the restart budget and, last, the exit code.
#
#   tools/launch/tpu_worker.sh --config=configs/NAME.py --config.workdir=gs://bucket/run [--config.key=value ...]
#
# The arguments are jaxtrain.main's. A fresh worker has no gcsfs (the gcs extra) nor s3fs (the s3 extra): a run whose
# workdir, checkpoint.dir, checkpoint.restore_from or data is on a store would stop at start on every worker. Which
# clients the config needs is asked of the config itself (tools/launch/store_clients.py), which needs jaxtrain
# installed: so jaxtrain first, then the question, then the clients.
# ACCELERATOR: the extra that brings the accelerator's jax and its plugin (default tpu: libtpu; '' for none, on a
# CPU host). Prints jaxtrain-restart-budget=N (distributed.max_restarts_per_hour) before the run and
# jaxtrain-exit-code=N after it, and exits N. A mistake in the arguments reports exit 2 before anything but jaxtrain
# is installed; a failed install exits 1 and reports nothing (as a worker that went away: the launcher runs every
# worker again, within its restart budget).
set -uo pipefail
accelerator=${ACCELERATOR-tpu}
python -m pip install -q -e ".${accelerator:+[$accelerator]}" || exit 1
clients=$(python tools/launch/store_clients.py "$@")
code=$?
if [ "$code" -ne 0 ]; then
  echo "jaxtrain-exit-code=$code"
  exit "$code"
fi
if [ -n "$clients" ]; then
  mapfile -t requirements <<< "$clients"  # one a line: gcsfs>=2024.2
  python -m pip install -q "${requirements[@]}" || exit 1
fi
echo "jaxtrain-restart-budget=$(python -m jaxtrain.main "$@" --config_value=distributed.max_restarts_per_hour)"
python -m jaxtrain.main "$@"
code=$?
echo "jaxtrain-exit-code=$code"
exit "$code"
