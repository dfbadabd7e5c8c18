#!/usr/bin/env bash
# up.sh - start the ckptless_hpc test cluster: a real Slurm 22.05 with N "nodes" on
# ONE Debian 12 host (munged + slurmctld + N slurmd), as root, no systemd.
#
#   up.sh [N]                 install the Debian packages if missing, start munged,
#                             slurmctld and N slurmd (nodes n1..nN, default 4), wait
#                             until all are idle, print sinfo. Idempotent: if the same
#                             N is up it only restarts missing slurmd's; if N differs,
#                             or the state dir is stale, it runs down.sh first.
#   up.sh --start-node NAME.. (re)start one node's slurmd, e.g. after
#                             `down.sh --crash-node NAME`; ReturnToService=2 makes the
#                             node idle again as soon as it registers (0.1-0.3 s).
#
# Every node is `slurmd -f CONF -N nX` with its own Port= on 127.0.0.1 (Debian's slurmd
# is built with MULTIPLE_SLURMD). All nodes share this host's hostname and port space:
# code must use $SLURMD_NODENAME, and workers need distinct or ephemeral ports.
# Nothing is written outside $CKPTLESS_SLURM_DIR (packages aside).
#
# Use it with:   source /tmp/ckptless-slurm/env.sh     (exports SLURM_CONF)
#
# Knobs (environment; project-specific names and defaults so this cluster never collides
# with another Slurm on the same machine, e.g. /work/shared/slurm-minicluster on 16817):
#   CKPTLESS_SLURM_DIR=/tmp/ckptless-slurm   state, config, logs, pid files, munge key
#   CKPTLESS_SLURM_CTLD_PORT=17817           slurmctld port
#   CKPTLESS_SLURM_NODE_PORT_BASE=17900      slurmd of node i listens on BASE+i
#   CKPTLESS_SLURM_CPUS=2  CKPTLESS_SLURM_MEM_MB=2048   advertised per node
#   CKPTLESS_SLURM_INSTALL=1                 0: never run apt-get
#   CKPTLESS_SLURM_WAIT_S=60                 how long to wait for nodes to be idle
set -euo pipefail

DIR=${CKPTLESS_SLURM_DIR:-/tmp/ckptless-slurm}
CTLD_PORT=${CKPTLESS_SLURM_CTLD_PORT:-17817}
NODE_PORT_BASE=${CKPTLESS_SLURM_NODE_PORT_BASE:-17900}
CPUS=${CKPTLESS_SLURM_CPUS:-2}
MEM_MB=${CKPTLESS_SLURM_MEM_MB:-2048}
INSTALL=${CKPTLESS_SLURM_INSTALL:-1}
WAIT_S=${CKPTLESS_SLURM_WAIT_S:-60}
PACKAGES=(munge slurmctld slurmd slurm-client iproute2 procps)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONF=$DIR/etc/slurm.conf
RUN=$DIR/run
MUNGE=$DIR/munge
MUNGE_SOCK=$MUNGE/run/munge.socket.2
MARKER=$DIR/.ckptless-slurm-cluster   # down.sh removes $DIR only when this exists
export SLURM_CONF=$CONF

log() { echo "[up.sh $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }
older_than() { [ "$(awk -v a="$1" -v b="$(now)" -v s="$2" 'BEGIN{print (b-a>s)}')" = 1 ]; }

if [ "$(id -u)" != 0 ]; then
  echo "up.sh: needs root (starts munged as user munge, slurmd/slurmctld as root, may apt-get install)." >&2
  echo "HINT: run it as root, e.g. sudo bash $0 ${*:-4}" >&2
  exit 2
fi

# One up.sh/down.sh at a time per state dir (two test sessions may start the cluster at
# once); the lock file lives beside $DIR because down.sh removes $DIR. down.sh run from
# here inherits the lock. Daemons are started with fd 9 closed (9>&-), or they would
# hold the lock forever.
if [ "${CKPTLESS_SLURM_LOCKED:-}" != "$DIR" ]; then
  exec 9>"$DIR.lock"
  flock -w 900 9 || die "another up.sh/down.sh holds $DIR.lock for 900 s"
  export CKPTLESS_SLURM_LOCKED=$DIR
fi

# pid_alive FILE COMM: FILE holds the pid of a live process named COMM. PID 1 on this kind
# of machine reaps orphans lazily, so a dead daemon stays a zombie (state Z) for seconds and
# `kill -0` still succeeds: look at /proc/PID/stat instead.
pid_alive() {
  local f=$1 comm=$2 p st
  [ -s "$f" ] || return 1
  p=$(tr -dc 0-9 <"$f"); [ -n "$p" ] || return 1
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$comm" ] || return 1
  st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null) || return 1
  [ "$st" != Z ] && [ "$st" != X ]
}
port_busy() { [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]; }
# Not `sinfo -n NODE`: that view was seen stuck at "mixed*" for 40 s while the full
# listing and slurmctld already said "down*".
node_state() { sinfo -h -N -o '%N %T' 2>/dev/null | awk -v n="$1" '$1==n {print $2; exit}'; }
node_names() { local i; for ((i = 1; i <= $1; i++)); do echo "n$i"; done; }

install_pkgs() {
  local missing=() p t0
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$INSTALL" = 1 ] || die "missing packages: ${missing[*]} (CKPTLESS_SLURM_INSTALL=0). HINT: apt-get install ${missing[*]}"
  t0=$(now); log "installing ${missing[*]}"
  # There is no init system: keep the packages' postinst from starting the system
  # munged/slurmctld/slurmd (they would take the default munge socket and ports).
  local made_policy=0 rc=0 aptlog=${TMPDIR:-/tmp}/ckptless-slurm-apt.log
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1
  fi
  # Lock timeout: another session may be installing the same packages right now.
  { apt-get -o DPkg::Lock::Timeout=300 update -q &&
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
      --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1 || rc=$?
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ $rc = 0 ] || { tail -20 "$aptlog" >&2; die "apt-get failed (rc=$rc, full log $aptlog)"; }
  log "installed ${missing[*]} in $(elapsed "$t0") s"
}

start_munge() {
  if pid_alive "$MUNGE/run/munged.pid" munged && [ -S "$MUNGE_SOCK" ]; then return 0; fi
  # munged is picky: key dir 0700, key 0400 owned by munge, socket dir a+x and not
  # world-writable -> separate etc/ run/ log/ lib/ dirs. Our private socket is handed to
  # Slurm with AuthInfo=socket=...; a system munged (default socket) is left alone.
  mkdir -p "$MUNGE"/{etc,run,log,lib}
  chmod 755 "$MUNGE" "$MUNGE/run"
  chmod 700 "$MUNGE/etc" "$MUNGE/log" "$MUNGE/lib"
  if [ ! -s "$MUNGE/etc/munge.key" ]; then
    mungekey -c -k "$MUNGE/etc/munge.key" 2>/dev/null ||
      dd if=/dev/urandom of="$MUNGE/etc/munge.key" bs=1 count=128 status=none
  fi
  chmod 400 "$MUNGE/etc/munge.key"
  chown -R munge:munge "$MUNGE"
  rm -f "$MUNGE_SOCK" "$MUNGE/run/munged.pid"
  runuser -u munge -- munged -S "$MUNGE_SOCK" --key-file="$MUNGE/etc/munge.key" \
    --log-file="$MUNGE/log/munged.log" --pid-file="$MUNGE/run/munged.pid" \
    --seed-file="$MUNGE/lib/munged.seed" 9>&- || die "munged failed: $(tail -2 "$MUNGE/log/munged.log" 2>/dev/null)"
  munge -S "$MUNGE_SOCK" -n | unmunge -S "$MUNGE_SOCK" >/dev/null || die "munge self-test failed"
}

write_conf() {  # write_conf N
  local n=$1 i host; host=$(hostname -s)
  {
    # SlurmctldHost needs the short hostname with the address in parentheses; MailProg must
    # exist. cred_expire=10: a requeued job waits cred_expire+1 s (121 s by default), and
    # only a slurmctld restart applies it (not `scontrol reconfigure`).
    # ReturnToService=2: a node comes back idle as soon as its slurmd registers, even one
    # set DOWN by hand; it never rejoins a running job.
    # Accounting is off (no sacct): use squeue and `scontrol show job` (MinJobAge=300 s).
    # CR_Core: memory is not tracked, so steps need no --mem=0.
    cat <<EOF
# Generated by tests/slurm_cluster/up.sh - ckptless_hpc test cluster, $n slurmd's on one host.
ClusterName=ckptless
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$NODE_PORT_BASE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
PropagateResourceLimits=NONE
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
TCPTimeout=2
KillWait=5
InactiveLimit=0
MinJobAge=300
ReturnToService=2
JobRequeue=1
EOF
    for ((i = 1; i <= n; i++)); do
      echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=n[1-$n] Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
}

write_env() {
  cat >"$DIR/env.sh" <<EOF
# source me: points the Slurm client commands at the ckptless_hpc test cluster
export SLURM_CONF=$CONF
export CKPTLESS_SLURM_DIR=$DIR
EOF
}

start_slurmd() {  # start_slurmd NAME
  local n=$1 port
  if pid_alive "$RUN/slurmd-$n.pid" slurmd; then log "slurmd $n already running"; return 0; fi
  grep -q "^NodeName=$n " "$CONF" || die "no node $n in $CONF. HINT: nodes are $(node_names "$(cat "$DIR/etc/nodecount")" | tr '\n' ' ')"
  rm -f "$RUN/slurmd-$n.pid"
  port=$(sed -n "s/^NodeName=$n .*Port=\([0-9]*\).*/\1/p" "$CONF")
  port_busy "$port" && die "port $port for $n is already in use. HINT: set CKPTLESS_SLURM_NODE_PORT_BASE"
  slurmd -f "$CONF" -N "$n" 9>&- || die "slurmd -N $n failed (see $DIR/log/slurmd-$n.log)"
}

wait_idle() {  # wait_idle COUNT
  local want=$1 t0 idle; t0=$(now)
  while :; do
    idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l || true)
    [ "$idle" -ge "$want" ] && return 0
    older_than "$t0" "$WAIT_S" && { sinfo -N -l >&2 || true; return 1; }
    sleep 0.2
  done
}

start_nodes_cmd() {  # up.sh --start-node NAME...
  [ $# -ge 1 ] || die "usage: up.sh --start-node NAME..."
  pid_alive "$RUN/slurmctld.pid" slurmctld || die "cluster is not up (no slurmctld at $DIR). HINT: bash $0 4"
  local n t0 st
  for n in "$@"; do
    t0=$(now); start_slurmd "$n"
    # responding again = no '*' and not down/unknown/fail (idle, or mixed if jobs use it)
    until st=$(node_state "$n") && [ -n "$st" ] &&
          [[ "$st" != *"*"* && "$st" != down* && "$st" != unk* && "$st" != fail* ]]; do
      older_than "$t0" 60 && { log "$n did not come back"; sinfo -N -l >&2; return 1; }
      sleep 0.1
    done
    log "$n: slurmd started, node state $st after $(elapsed "$t0") s"
  done
}

# ---------------------------------------------------------------------------
if [ "${1:-}" = --start-node ]; then shift; start_nodes_cmd "$@"; exit $?; fi

N=${1:-4}
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] || die "usage: up.sh [N] | up.sh --start-node NAME (got '$N')"
T0=$(now)
install_pkgs

if pid_alive "$RUN/slurmctld.pid" slurmctld; then
  if [ "$(cat "$DIR/etc/nodecount" 2>/dev/null)" = "$N" ]; then
    for n in $(node_names "$N"); do start_slurmd "$n"; done
    wait_idle "$N" || log "warning: not all $N nodes idle (jobs running?)"
    log "cluster already up ($N nodes) at $DIR"
    sinfo
    exit 0
  fi
  log "cluster up with another node count: restarting"
  bash "$HERE/down.sh"
fi
# leftovers of a run that died without down.sh: down.sh stops what $DIR recorded
if [ -d "$DIR" ]; then
  log "stale $DIR found: cleaning it up with down.sh"
  bash "$HERE/down.sh"
  [ -d "$DIR" ] && die "$DIR still exists and is not ours (no $MARKER). HINT: set CKPTLESS_SLURM_DIR"
fi

# Another Slurm may run on this machine (the shared recipe used 16817/16900+; someone else
# 26817/27001+). The daemons bind 0.0.0.0 and 22.05 cannot change that: fail fast.
port_busy "$CTLD_PORT" && die "port $CTLD_PORT (slurmctld) in use. HINT: set CKPTLESS_SLURM_CTLD_PORT"
for ((i = 1; i <= N; i++)); do
  port_busy $((NODE_PORT_BASE + i)) && die "port $((NODE_PORT_BASE + i)) in use. HINT: set CKPTLESS_SLURM_NODE_PORT_BASE"
done

mkdir -p "$DIR"/{etc,ctld,spool,log,run}
chmod 755 "$DIR"
touch "$MARKER"
start_munge
write_conf "$N"
echo "$N" >"$DIR/etc/nodecount"
write_env

t=$(now)
slurmctld -f "$CONF" 9>&- || die "slurmctld failed: $(tail -3 "$DIR/log/slurmctld.log")"
# its log shows harmless errors: "mpi/pmix_v4: can not load PMIx library", missing state files
until scontrol ping 2>/dev/null | grep -q UP; do
  older_than "$t" 30 && die "slurmctld not answering: $(tail -3 "$DIR/log/slurmctld.log")"
  sleep 0.1
done
log "slurmctld up after $(elapsed "$t") s"

t=$(now)
for n in $(node_names "$N"); do start_slurmd "$n"; done
wait_idle "$N" || die "not all $N nodes became idle within ${WAIT_S}s (logs in $DIR/log)"
log "$N nodes idle after $(elapsed "$t") s; cluster up in $(elapsed "$T0") s total"
log "use it with: source $DIR/env.sh   (SLURM_CONF=$CONF)"
sinfo
