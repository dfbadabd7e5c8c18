#!/usr/bin/env bash
# down.sh - stop the test cluster started by up.sh, or crash single nodes.
#
#   down.sh                      cancel all jobs, stop every slurmd (and any slurmstepd or
#                                job process left on its spool dir), slurmctld and munged,
#                                then remove $CKPTLESS_SLURM_DIR (keep it with
#                                CKPTLESS_SLURM_KEEP_DIR=1).
#   down.sh --crash-node NAME..  a hard failure of the named nodes, all in one instant:
#                                SIGSTOP, then SIGKILL, of each one's slurmd, slurmstepd's
#                                and every process below them (tasks, batch script, sruns,
#                                srun's shepherds). Slurm marks a crashed node DOWN
#                                only 14-20 s later (see README.md); bring it back with
#                                `up.sh --start-node NAME`.
#   down.sh --kill-slurmd NAME   SIGKILL the node's slurmd alone: its slurmstepd's and tasks
#                                live on, unreachable for Slurm, which marks the node DOWN
#                                ~20 s later and ends the node's steps' sruns (rc 0, "Node
#                                failure"); `up.sh --start-node NAME` brings it back.
#
# Stops only what up.sh (or Slurm on its behalf) started; never pkill/killall. The pids
# come from the pid files in $DIR/run, from the listening sockets of slurmstepd under
# $DIR/spool/<node>/ (ss -xlp), and from walking /proc parent links below those.
set -uo pipefail

DIR=${CKPTLESS_SLURM_DIR:-/tmp/ckptless-slurm}
KEEP_DIR=${CKPTLESS_SLURM_KEEP_DIR:-0}
CONF=$DIR/etc/slurm.conf
RUN=$DIR/run
MUNGE=$DIR/munge
MARKER=$DIR/.ckptless-slurm-cluster
export SLURM_CONF=$CONF

log() { echo "[down.sh $(date +%T)] $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  echo "down.sh: needs root (the cluster's daemons run as root and munge)." >&2
  echo "HINT: run it as root, e.g. sudo bash $0 $*" >&2
  exit 2
fi

pid_of() {  # pid_of FILE COMM -> the pid, if live and named COMM
  local f=$1 comm=$2 p st
  [ -s "$f" ] || return 1
  p=$(tr -dc 0-9 <"$f"); [ -n "$p" ] || return 1
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$comm" ] || return 1
  st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null) || return 1
  { [ "$st" = Z ] || [ "$st" = X ]; } && return 1
  echo "$p"
}
alive() {  # alive PID: exists and is not a zombie (PID 1 here reaps orphans lazily)
  local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ "$st" != Z ] && [ "$st" != X ]
}
wait_gone() {  # wait_gone SECONDS PID... -> prints the pids still alive on timeout
  local end=$(( $(date +%s) + $1 )); shift
  local p left
  while :; do
    left=""; for p in "$@"; do alive "$p" && left="$left $p"; done
    [ -z "$left" ] && return 0
    [ "$(date +%s)" -ge "$end" ] && { echo "$left"; return 1; }
    sleep 0.1
  done
}
descendants() {  # descendants PID... -> the pids and all their descendants
  local p
  for p in "$@"; do
    echo "$p"
    descendants $(ps -o pid= --ppid "$p" 2>/dev/null)
  done
}
leaves_first() {  # leaves_first PID... -> the pids and all their descendants, children before parents
  local p
  for p in "$@"; do
    leaves_first $(ps -o pid= --ppid "$p" 2>/dev/null)
    echo "$p"
  done
}
# slurmstepd's of NODE: every stepd listens on a socket under the node's spool dir
stepds_of() {
  ss -xlpH 2>/dev/null | grep -F " $DIR/spool/$1/" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -un
}
all_nodes() { { ls "$RUN" 2>/dev/null | sed -n 's/^slurmd-\(.*\)\.pid$/\1/p'; ls "$DIR/spool" 2>/dev/null; } | sort -u; }

freeze_node() {  # freeze_node NAME -> prints the pids of its slurmd, stepds and everything below, all SIGSTOPped
  local n=$1 dpid stepds all prev="" i
  dpid=$(pid_of "$RUN/slurmd-$n.pid" slurmd || true)
  stepds=$(stepds_of "$n")
  # Freeze the whole tree before killing any of it: nothing may act on a sibling's death in
  # between. srun forks a shepherd that cancels its step (on the *other* node) when srun dies
  # by SIGKILL; on a real crash the shepherd dies in the same instant, so it must never get
  # to run here either. Re-walk until no process appears (a live parent may fork meanwhile).
  # The kill then goes leaves first: a stopped process whose process group is orphaned (its
  # parent died) gets SIGHUP + SIGCONT from the kernel, and srun answers SIGHUP by cancelling
  # its step ("srun: forcing job termination"); with children killed before their parents,
  # every process already has its SIGKILL pending when that could happen.
  [ -n "$dpid$stepds" ] && kill -STOP $dpid $stepds 2>/dev/null
  all="$(leaves_first $stepds | awk '!seen[$0]++' | tr '\n' ' ')$dpid"
  for i in 1 2 3 4 5; do
    [ "$all" = "$prev" ] && break
    kill -STOP $all 2>/dev/null
    prev=$all
    all="$(leaves_first $stepds | awk '!seen[$0]++' | tr '\n' ' ')$dpid"
  done
  log "$n frozen: slurmd=${dpid:-none} slurmstepd=[$(echo $stepds)] leaves first=[$(echo $all)]"
  echo $all
}

crash_nodes() {  # crash_nodes NAME... : every named node fails in the same instant
  local n all=""
  for n in "$@"; do all="$all $(freeze_node "$n")"; done
  if [ -z "${all// /}" ]; then log "$*: nothing running"; return 0; fi
  kill -KILL $all 2>/dev/null
  log "$* crashed at $(date +%s.%N)"
  wait_gone 5 $all >/dev/null || log "$*: some pids still alive"
}

if [ "${1:-}" = --kill-slurmd ]; then
  shift; [ $# -eq 1 ] || { log "usage: down.sh --kill-slurmd NAME"; exit 2; }
  p=$(pid_of "$RUN/slurmd-$1.pid" slurmd) || { log "$1: no live slurmd"; exit 1; }
  kill -KILL "$p"
  log "$1: slurmd $p killed at $(date +%s.%N); its steps live on"
  wait_gone 5 "$p" >/dev/null || log "$1: slurmd $p still alive"
  exit 0
fi

if [ "${1:-}" = --crash-node ]; then
  shift; [ $# -ge 1 ] || { log "usage: down.sh --crash-node NAME..."; exit 2; }
  [ -d "$DIR" ] || { log "no cluster at $DIR"; exit 1; }
  crash_nodes "$@"
  exit 0
fi

[ -d "$DIR" ] || { log "nothing at $DIR"; exit 0; }
if [ "${CKPTLESS_SLURM_LOCKED:-}" != "$DIR" ]; then  # see up.sh: one at a time
  exec 9>"$DIR.lock"
  flock -w 900 9 || { log "another up.sh/down.sh holds $DIR.lock for 900 s"; exit 1; }
fi

# 1. cancel jobs while slurmctld is still there, give them KillWait to end
ctld=$(pid_of "$RUN/slurmctld.pid" slurmctld || true)
if [ -n "$ctld" ]; then
  jobs=$(timeout 10 squeue -h -o '%A' 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    timeout 10 scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 80); do
      [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
fi

# 2. slurmd's: SIGTERM, then anything still on the node's spool dir is killed hard
dpids=""
for n in $(all_nodes); do
  p=$(pid_of "$RUN/slurmd-$n.pid" slurmd || true)
  [ -n "$p" ] && { kill -TERM "$p" 2>/dev/null; dpids="$dpids $p"; }
done
if [ -n "$dpids" ]; then
  left=$(wait_gone 10 $dpids) || { log "SIGKILL slurmd:$left"; kill -KILL $left 2>/dev/null; }
fi
for n in $(all_nodes); do
  s=$(stepds_of "$n")
  if [ -n "$s" ]; then
    kill -STOP $s 2>/dev/null
    t=$(descendants $s | sort -un)
    log "killing leftover slurmstepd trees of $n: $(echo $t)"
    kill -KILL $t 2>/dev/null
  fi
done

# 3. slurmctld (its child slurmscriptd exits with it)
if [ -n "$ctld" ]; then
  kids=$(ps -o pid= --ppid "$ctld" 2>/dev/null | tr '\n' ' ')
  kill -TERM "$ctld" 2>/dev/null
  wait_gone 15 "$ctld" >/dev/null || { log "SIGKILL slurmctld"; kill -KILL "$ctld" 2>/dev/null; }
  if [ -n "${kids// /}" ]; then left=$(wait_gone 5 $kids) || kill -KILL $left 2>/dev/null; fi
fi

# 4. munged
m=$(pid_of "$MUNGE/run/munged.pid" munged || true)
if [ -n "$m" ]; then
  kill -TERM "$m" 2>/dev/null
  wait_gone 5 "$m" >/dev/null || kill -KILL "$m" 2>/dev/null
fi

# 5. files: only a directory up.sh created (it holds our marker) is removed
if [ "$KEEP_DIR" = 1 ]; then
  log "stopped; kept $DIR"
elif [ -e "$MARKER" ]; then
  rm -rf "$DIR"
  log "stopped; removed $DIR"
else
  log "stopped; left $DIR in place: it has no $MARKER, so up.sh did not create it"
fi
