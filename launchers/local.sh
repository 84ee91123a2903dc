#!/usr/bin/env bash
# One host: edit-train spawns cluster.count x cluster.ranks processes itself (torch's elastic launcher).
#   launchers/local.sh cluster=local_2x2 algo=edit train.steps=400
set -euo pipefail
exec edit-train "$@"
