#!/usr/bin/env bash
# jaxtrain.main on this machine, run again whenever it exits 75 (stopped early for a cause a restart cures: a
# SIGTERM after its save, a lost peer, a hang; exit codes: docs/operations.md), at most MAX_RESTARTS times. Any
# other exit code ends it and is its exit code; so does a SIGTERM or Ctrl-C sent to this script (jaxtrain saves
# first).
#   tools/launch/local.sh CONFIG WORKDIR [--config.key=value ...]
set -uo pipefail
CONFIG=${1:?usage: tools/launch/local.sh CONFIG WORKDIR [overrides...]}
WORKDIR=${2:?usage: tools/launch/local.sh CONFIG WORKDIR [overrides...]}
shift 2
stopping=""
trap 'stopping=1' INT  # the terminal sends Ctrl-C to jaxtrain too
trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM
for ((restart = 0; ; restart++)); do
  python -m jaxtrain.main --config="$CONFIG" --config.workdir="$WORKDIR" "$@" &
  child=$!
  while true; do  # a trapped signal ends the wait early: wait again for jaxtrain's own exit code
    wait "$child"
    code=$?
    kill -0 "$child" 2>/dev/null || break
  done
  if [ "$code" -ne 75 ] || [ -n "$stopping" ] || [ "$restart" -ge "${MAX_RESTARTS:-100}" ]; then
    exit "$code"
  fi
  echo "jaxtrain exited 75 (restartable): starting it again (restart $((restart + 1)))" >&2
done
