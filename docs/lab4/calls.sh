#!/bin/bash
# Lab IV's registered calls, in the registered order (docs/lab4/registration.md, "Cost, and the calls"). Each call is
# resumable: rerunning this script skips finished runs and resumes interrupted ones. It runs trustbatch from TREE, a
# clean checkout at a commit that descends from the registration commit 1f80936 (make one with
# `git worktree add --detach TREE ac76826`), with PY an interpreter that has the lab extra.
#   TREE=... OUT=... STORE=... [PY=...] [JOBS=2] docs/lab4/calls.sh
set -euo pipefail
: "${TREE:?set TREE to a clean checkout descending from 1f80936}" "${OUT:?set OUT}" "${STORE:?set STORE (the base store)}"
PY=${PY:-python3}
JOBS=${JOBS:-2}
export TRUSTBATCH_CACHE=$STORE PYTHONPATH=$TREE/src
if [ -n "$(git -C "$TREE" status --porcelain --untracked-files=no)" ]; then
  echo "$TREE has uncommitted changes; the calls must run from a commit" >&2; exit 2
fi
git -C "$TREE" merge-base --is-ancestor 1f80936 HEAD || { echo "$TREE does not descend from 1f80936" >&2; exit 2; }
cd "$TREE"
[ -f "$OUT/confirm_t12/preflight.json" ] || "$PY" -m trustbatch lab preflight confirm_t12 --out "$OUT"
for arms in p3o@T1.2,grpo_eps0.4@T1.2 p3o@T1.0,grpo_eps0.4@T1.0; do
  for seeds in 20,21,22,23 24,25,26,27 28,29,30,31 32,33,34,35; do
    "$PY" -m trustbatch lab run confirm_t12 --arms "$arms" --seeds "$seeds" --out "$OUT" --jobs "$JOBS"
  done
done
echo "all registered calls done: archive, then report (registration.md)"
