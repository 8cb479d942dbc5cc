#!/usr/bin/env bash
# jaxtrain.main on this machine, run again whenever it exits 75 (stopped early for a cause a restart cures: a
# SIGTERM after its save, a lost peer, a hang; exit codes: docs/operations.md), at most MAX_RESTARTS times in all
# and at most distributed.max_restarts_per_hour times in any hour (the config's value, read from jaxtrain): one more
# exit 75 within the hour ends it with exit 3, naming the restarts. Any other exit code ends it and is its exit
# code; so does a SIGTERM or Ctrl-C sent to this script (jaxtrain saves first). PYTHON picks the interpreter.
#   tools/launch/local.sh CONFIG WORKDIR [--config.key=value ...]
set -uo pipefail
CONFIG=${1:?usage: tools/launch/local.sh CONFIG WORKDIR [overrides...]}
WORKDIR=${2:?usage: tools/launch/local.sh CONFIG WORKDIR [overrides...]}
shift 2
PYTHON=${PYTHON:-python}
# The budget, as jaxtrain reads it (the config file with the overrides); a mistake in them is reported here, exit 2.
budget=$("$PYTHON" -m jaxtrain.main --config="$CONFIG" --config.workdir="$WORKDIR" "$@" \
         --config_value=distributed.max_restarts_per_hour) || exit $?
stopping=""
trap 'stopping=1' INT  # the terminal sends Ctrl-C to jaxtrain too
trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM
restarted=()  # when this script restarted jaxtrain (seconds since the epoch)
for ((restart = 0; ; restart++)); do
  "$PYTHON" -m jaxtrain.main --config="$CONFIG" --config.workdir="$WORKDIR" "$@" &
  child=$!
  while true; do  # a trapped signal ends the wait early: wait again for jaxtrain's own exit code
    wait "$child"
    code=$?
    kill -0 "$child" 2>/dev/null || break
  done
  if [ "$code" -ne 75 ] || [ -n "$stopping" ] || [ "$restart" -ge "${MAX_RESTARTS:-100}" ]; then
    exit "$code"
  fi
  now=$(date +%s)
  recent=()
  for t in ${restarted[@]+"${restarted[@]}"}; do
    if [ $((now - t)) -lt 3600 ]; then recent+=("$t"); fi
  done
  restarted=(${recent[@]+"${recent[@]}"})
  if [ "$budget" -gt 0 ] && [ "${#restarted[@]}" -ge "$budget" ]; then
    echo "jaxtrain: stopped: it exited 75 again after ${#restarted[@]} restarts in the last hour, the most" \
         "distributed.max_restarts_per_hour=$budget allows: a restart does not cure this; see $WORKDIR/train.log" \
         "(exit 3)" >&2
    exit 3
  fi
  restarted+=("$now")
  echo "jaxtrain exited 75 (restartable): starting it again (restart $((restart + 1)))" >&2
done
