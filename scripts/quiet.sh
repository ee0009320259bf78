#!/usr/bin/env bash
# Run a command with this machine's background training jobs (dmtd data / cache / train) paused, so that a
# benchmark measures the machine alone; they are resumed when the command ends, however it ends.
#   bash scripts/quiet.sh .venv/bin/dmtd bench serve --compare-engine ...
# Only python processes running those commands are paused, never this script, its parents or the command.
set -uo pipefail
# A job paused while it holds torch's build lock of the low-bit kernels (its first start on a machine) would
# leave the benchmark's replica waiting on that lock for good: wait for the build to end first.
for _ in $(seq 300); do
  compgen -G "${DMTD_CACHE:-$HOME/.cache/dmtd}/kernels/*/lock" >/dev/null || break
  [ "${announced:-}" ] || { echo "quiet.sh: waiting for a low-bit kernel build to finish" >&2; announced=1; }
  sleep 1
done
pids=$(pgrep -f 'python[0-9.]* [^ ]*dmtd (data|cache|train) ' | tr '\n' ' ')
resume() { [ -n "$pids" ] && kill -CONT $pids 2>/dev/null; true; }
trap resume EXIT INT TERM
[ -n "$pids" ] && kill -STOP $pids && echo "quiet.sh: paused $pids" >&2
"$@"
