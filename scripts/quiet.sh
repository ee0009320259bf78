#!/usr/bin/env bash
# Run a command with this machine's background training jobs (dmtd data / cache / train) paused, so that a
# benchmark measures the machine alone; they are resumed when the command ends, however it ends.
#   bash scripts/quiet.sh .venv/bin/dmtd bench serve --compare-engine ...
# Only python processes running those commands are paused, never this script, its parents or the command.
set -uo pipefail
pids=$(pgrep -f 'python[0-9.]* [^ ]*dmtd (data|cache|train) ' | tr '\n' ' ')
resume() { [ -n "$pids" ] && kill -CONT $pids 2>/dev/null; true; }
trap resume EXIT INT TERM
[ -n "$pids" ] && kill -STOP $pids && echo "quiet.sh: paused $pids" >&2
"$@"
