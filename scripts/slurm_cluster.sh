#!/usr/bin/env bash
# A private Slurm cluster of N nodes on this one machine, for Transom's Slurm tests and demos.
#
#   scripts/slurm_cluster.sh start  [DIR] [N]   install Slurm + munge if missing (root, apt-get),
#                                              write DIR/slurm.conf, start munged, slurmctld and
#                                              one slurmd per node (n1..nN), wait until sinfo
#                                              shows every node idle
#   scripts/slurm_cluster.sh stop   [DIR]       stop exactly the daemons `start` started (their
#                                              pid files in DIR), and every job step under them
#   scripts/slurm_cluster.sh status [DIR]       sinfo and squeue of the cluster
#   scripts/slurm_cluster.sh env    [DIR]       the line to source to use it: export SLURM_CONF=...
#
# DIR defaults to /tmp/transom-slurm, N to 4. Clients find the cluster through
# SLURM_CONF=DIR/slurm.conf. Everything is private to DIR: its own munged (own socket and key),
# state, spool and log directories, ports 16817 (slurmctld) and 17001.. (slurmd n1..). The nodes
# are declared NodeHostname=localhost NodeAddr=127.0.0.1 Port=<own port>, and each slurmd is
# started as `slurmd -N nI` (Debian's slurmd is built with multiple-slurmd support).
# Exit codes: 0 done; 1 a daemon did not start or the nodes did not come up (see DIR/log);
# 3 Slurm is not installed and cannot be (not root, or apt-get failed): the reason is printed.
set -euo pipefail

CMD=${1:-}
DIR=${2:-/tmp/transom-slurm}
N=${3:-4}
CTLD_PORT=${TRANSOM_SLURM_CTLD_PORT:-16817}
FIRST_NODE_PORT=${TRANSOM_SLURM_NODE_PORT:-17001}
CPUS=${TRANSOM_SLURM_CPUS:-2}          # per node; the host's cores are shared by all nodes
MEMORY_MB=${TRANSOM_SLURM_MEMORY_MB:-2048}
START_TIMEOUT_S=60
PACKAGES=(slurmctld slurmd slurm-client munge)

die() { echo "slurm_cluster: $*" >&2; exit "${2:-1}"; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sinfo >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and this is not root: apt-get install ${PACKAGES[*]}" 3
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get" 3
    export DEBIAN_FRONTEND=noninteractive
    # Packages' own services must not start (the cluster runs on private ports from DIR).
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >"$DIR/apt.log" 2>&1; then
        apt-get update -q >>"$DIR/apt.log" 2>&1 || true
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >>"$DIR/apt.log" 2>&1 \
            || die "apt-get install ${PACKAGES[*]} failed: see $DIR/apt.log" 3
    fi
}

write_config() {
    local last=$((FIRST_NODE_PORT + N - 1))
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/munge"
    chmod 700 "$DIR/munge"
    [ -f "$DIR/munge/munge.key" ] || {
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 600 "$DIR/munge/munge.key"
    }
    cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm_cluster.sh: a private $N-node cluster on this machine.
ClusterName=transom
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# A node whose slurmd stops answering is DOWN after 10 s; a drained or downed node that
# registers again comes back only when told (ReturnToService=1: only if it was down for
# not responding).
SlurmdTimeout=10
SlurmctldTimeout=30
ReturnToService=1
KillWait=15
InactiveLimit=0
MinJobAge=300
NodeName=n[1-$N] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$FIRST_NODE_PORT-$last] CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=n[1-$N] Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    mkdir -p "$DIR"
    install_packages
    write_config
    export SLURM_CONF="$DIR/slurm.conf"
    if ! alive "$DIR/munged.pid"; then
        munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
            --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
            --seed-file="$DIR/munge/munge.seed" || die "munged did not start: see $DIR/log/munged.log"
    fi
    alive "$DIR/slurmctld.pid" || slurmctld -f "$SLURM_CONF" -i \
        || die "slurmctld did not start: see $DIR/log/slurmctld.log"
    for i in $(seq 1 "$N"); do
        mkdir -p "$DIR/spool/n$i"
        alive "$DIR/slurmd-n$i.pid" || slurmd -f "$SLURM_CONF" -N "n$i" \
            || die "slurmd -N n$i did not start: see $DIR/log/slurmd-n$i.log"
    done
    local deadline=$((SECONDS + START_TIMEOUT_S)) idle
    while :; do
        idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)
        [ "$idle" -ge "$N" ] && break
        # A node left down or drained by an earlier run of this cluster: tell it to serve again.
        scontrol update nodename="n[1-$N]" state=resume >/dev/null 2>&1 || true
        [ $SECONDS -lt $deadline ] || die "only $idle of $N nodes idle after ${START_TIMEOUT_S}s: see $DIR/log"
        sleep 0.5
    done
    echo "slurm_cluster: $N nodes idle; use: export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {
    local pidfile=$1 pid
    alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stop() {
    export SLURM_CONF="$DIR/slurm.conf"
    [ -f "$SLURM_CONF" ] || { echo "slurm_cluster: no cluster in $DIR"; return 0; }
    # Jobs first (their steps run under the slurmd daemons), then the daemons.
    if alive "$DIR/slurmctld.pid"; then
        scancel --full --quiet --signal=KILL "$(squeue -h -o %i | tr '\n' ' ')" >/dev/null 2>&1 || true
    fi
    # Step daemons (slurmstepd) are not children of slurmd: find them by their spool directory.
    local pids
    pids=$(pgrep -f "slurmstepd: \[" || true)
    for pid in $pids; do
        if grep -qz "SLURM_CONF=$SLURM_CONF" "/proc/$pid/environ" 2>/dev/null \
            || tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$DIR"; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    for f in "$DIR"/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
    stop_pidfile "$DIR/slurmctld.pid"
    stop_pidfile "$DIR/munged.pid"
    echo "slurm_cluster: stopped the cluster in $DIR"
}

case "$CMD" in
    start) start ;;
    stop) stop ;;
    status) export SLURM_CONF="$DIR/slurm.conf"; sinfo -N -l; squeue ;;
    env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
    *) die "usage: $0 start|stop|status|env [DIR] [NODES]" 2 ;;
esac
