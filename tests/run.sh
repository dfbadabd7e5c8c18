#!/usr/bin/env bash
# The test command (README, CI): installs everything the suite needs on a fresh Debian 12
# machine and runs all of it: ruff check on the package, unit tests, local end-to-end runs with
# real processes and signals, and integration tests against a real Slurm mini-cluster (munge +
# slurmctld + 4 slurmd) that tests/slurm_cluster/up.sh installs and starts. As root the Slurm tests must
# run (CKPTLESS_REQUIRE_SLURM=1: a cluster that cannot start fails the run); without root
# they skip with the reason. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[test,examples]'
# real defects and the format first (pyproject.toml [tool.ruff]): seconds, before any cluster starts
"$PY" -m ruff check ckptless_hpc
"$PY" -m ruff format --check ckptless_hpc  # the package is ruff-formatted ([tool.ruff.format]): run `ruff format ckptless_hpc`
export CKPTLESS_REQUIRE_EXAMPLES=${CKPTLESS_REQUIRE_EXAMPLES:-1}
if [ "$(id -u)" = 0 ]; then
  export CKPTLESS_REQUIRE_SLURM=${CKPTLESS_REQUIRE_SLURM:-1}
  export CKPTLESS_REQUIRE_MOUNT=${CKPTLESS_REQUIRE_MOUNT:-1}  # the full-disk and read-only tests' tmpfs (tests/unit/conftest.py): a failed mount fails them
  bash tests/slurm_cluster/up.sh 4
  # what the test command started, it stops when it ends (CKPTLESS_KEEP_SLURM=1 keeps the
  # mini-cluster running for more runs; stop it later with bash tests/slurm_cluster/down.sh)
  if [ "${CKPTLESS_KEEP_SLURM:-0}" != 1 ]; then
    trap 'bash tests/slurm_cluster/down.sh >/dev/null 2>&1 || echo "tests/run.sh: down.sh failed; stop the mini-cluster by hand" >&2' EXIT
  fi
fi
if [ $# -gt 0 ] || [ "${CKPTLESS_REQUIRE_SLURM:-0}" != 1 ] || [ "${CKPTLESS_SERIAL:-0}" = 1 ]; then
  "$PY" -m pytest -q -ra --durations=40 "$@"
  exit
fi
# The whole suite as root, in two pytest processes at once: the Slurm tests, the bench smokes,
# the zoo, the security tests and the examples in the second, everything else in the first. Much
# of the Slurm tests' time is spent waiting on slurmctld (requeue delays, node timeouts, step
# relaunches: measured, they kept 1.2 of the 2 cores busy); the rest follows them there, so that
# the two end at about the same time (measured 2026-12-07: with the Slurm tests and the bench
# smokes alone there, the second ended after 21 minutes and the first after 43; with these, both
# after 33).
# The second's report is printed when both are done; the run fails if either does
# (CKPTLESS_SERIAL=1: one pytest, one test after the other).
beside=(tests/slurm tests/bench tests/e2e/test_zoo.py tests/security tests/examples)
beside_log=$(mktemp /tmp/ckptless-tests-beside.XXXXXX)
"$PY" -m pytest -q -ra --durations=20 -p no:cacheprovider "${beside[@]}" >"$beside_log" 2>&1 &
beside_pid=$!
trap 'kill "$beside_pid" 2>/dev/null' INT TERM  # interrupted: the second pytest stops too (the EXIT trap above still runs)
rest=0
"$PY" -m pytest -q -ra --durations=40 "${beside[@]/#/--ignore=}" || rest=$?
other=0
wait "$beside_pid" || other=$?
echo "=== ${beside[*]} (the second pytest, run beside the rest): exit $other ==="
cat "$beside_log"
rm -f "$beside_log"
[ "$rest" = 0 ] && [ "$other" = 0 ]
