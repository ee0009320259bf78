#!/usr/bin/env bash
# Run a command with this machine's background training jobs (dmtd data / cache / train) paused, so that a
# benchmark measures the machine alone; they are resumed when the command ends, however it ends.
#   bash scripts/quiet.sh .venv/bin/dmtd bench serve --compare-engine ...
# Only python processes running those commands are paused, never this script, its parents or the command.
set -uo pipefail
pids=""
for pid in $(pgrep -f 'python[0-9.]* [^ ]*dmtd (data|cache|train) '); do
  cmd=$(tr "\\0" " " < /proc/$pid/cmdline 2>/dev/null)
  case "$cmd" in
    *python*dmtd\ data\ *|*python*dmtd\ cache\ *|*python*dmtd\ train\ *) pids="$pids $pid" ;;
  esac
done
resume() { [ -n "$pids" ] && kill -CONT $pids 2>/dev/null; true; }
trap resume EXIT INT TERM
[ -n "$pids" ] && kill -STOP $pids && echo "quiet.sh: paused$pids" >&2
"$@"
