#!/bin/bash
# Issue 32's rehearsal: the --slurm script on a real two-node Slurm cluster on one Linux box (as root).
#
#   node0, node1: two network namespaces joined by a veth pair (both ends named scnet, 10.77.0.1/.2),
#   each with a hostname of its own (a UTS namespace) and its own /etc/hosts (/etc/netns/<ns>/hosts);
#   Debian's slurm-wlm: slurmctld and a slurmd on node0, a slurmd on node1 (auth/none: no munge).
#   The filesystem is shared, as a cluster's run folder must be.
#
# Then: a two-node tiny-cpu run is submitted, cancelled with a plain `scancel` (SIGTERM, KillWait later
# SIGKILL), resubmitted (it resumes), stopped with `shardconsole stop` from node0, resubmitted again, and
# node1 is killed (every process in its namespace, kill -9); it comes back, Slurm runs the requeued job,
# which resumes, and `scancel --batch --signal=USR1` stops it cleanly. Each step prints what the stream and
# `shardconsole attach` say. One command:
#
#   apt-get install -y slurm-wlm && sudo benchmarks/slurm_netns.sh        (from the repository root)
#
# SC_KEEP=1 leaves the cluster up; `benchmarks/slurm_netns.sh down` removes it.
set -uo pipefail

W=${SC_WORK:-/tmp/sc_slurm}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${SC_PYTHON:-$(command -v python)}
export SLURM_CONF=$W/slurm.conf PYTHONPATH=$REPO DS_ACCELERATOR=cpu SHARDCONSOLE_RUNS_ROOT=$W/runs
NS=(sc_n0 sc_n1)

down() {
    for pidfile in "$W"/slurmd.node*.pid "$W"/ctld.pid; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
    done
    sleep 1
    for ns in "${NS[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null
        rm -rf "/etc/netns/$ns"
    done
}

on() {   # on NODE_INDEX COMMAND...: run in that node's namespaces, with its hostname
    local i=$1; shift
    ip netns exec "${NS[$i]}" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" "$@"
}

start_slurmd() {
    # ip netns exec gives each command a fresh /sys (no cgroup mounted): slurmd's cgroup/v1 plugin gets
    # its controllers in that namespace, mounted by the shell that then becomes slurmd
    on "$1" sh -c 'mount -t tmpfs none /sys/fs/cgroup && for c in freezer memory cpuset devices pids; do
        mkdir -p "/sys/fs/cgroup/$c" && mount -t cgroup -o "$c" none "/sys/fs/cgroup/$c"; done
        exec slurmd -D -f "$0" -N "$1"' "$SLURM_CONF" "node$1" >> "$W/slurmd.node$1.stdout" 2>&1 &
}

up() {
    down
    rm -rf "$W"; mkdir -p "$W/ctld" "$W/spool/node0" "$W/spool/node1" "$W/runs"
    for i in 0 1; do
        ip netns add "${NS[$i]}"
        mkdir -p "/etc/netns/${NS[$i]}"
        printf '127.0.0.1 localhost\n10.77.0.1 node0\n10.77.0.2 node1\n' > "/etc/netns/${NS[$i]}/hosts"
    done
    ip link add sc_v0 type veth peer name sc_v1
    for i in 0 1; do
        ip link set "sc_v$i" netns "${NS[$i]}"
        ip netns exec "${NS[$i]}" ip link set "sc_v$i" name scnet
        ip netns exec "${NS[$i]}" ip addr add "10.77.0.$((i + 1))/24" dev scnet
        ip netns exec "${NS[$i]}" ip link set scnet up
        ip netns exec "${NS[$i]}" ip link set lo up
    done
    cat > "$SLURM_CONF" <<EOF
ClusterName=sc
SlurmctldHost=node0(10.77.0.1)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$W/ctld
SlurmdSpoolDir=$W/spool/%n
SlurmctldPidFile=$W/ctld.pid
SlurmdPidFile=$W/slurmd.%n.pid
SlurmctldLogFile=$W/ctld.log
SlurmdLogFile=$W/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=30
SlurmdTimeout=20
InactiveLimit=0
NodeName=node0 NodeAddr=10.77.0.1 CPUs=$(nproc) RealMemory=4000 State=UNKNOWN
NodeName=node1 NodeAddr=10.77.0.2 CPUs=$(nproc) RealMemory=4000 State=UNKNOWN
PartitionName=main Nodes=node0,node1 Default=YES MaxTime=INFINITE State=UP
EOF
    printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\n' \
        > "$W/cgroup.conf"
    on 0 slurmctld -D -f "$SLURM_CONF" > "$W/ctld.stdout" 2>&1 &
    sleep 2
    for i in 0 1; do start_slurmd "$i"; done
    for _ in $(seq 60); do
        [ "$(on 0 sinfo -h -o %T | sort -u)" = "idle" ] && { echo "cluster up: $(on 0 sinfo -h -N -o '%N %T' | tr '\n' ' ')"; return 0; }
        sleep 1
    done
    echo "the cluster did not come up:"; on 0 sinfo; for f in "$W"/*.log; do echo "== $f"; tail -n 20 "$f"; done
    return 1
}

steps_of() {   # the step lines of the stream so far (every node's file)
    cat "$RUN"/metrics*.jsonl 2>/dev/null | grep -c '"kind":"step"'
}

wait_steps() {   # wait_steps N SECONDS
    for _ in $(seq "$2"); do [ "$(steps_of)" -ge "$1" ] && return 0; sleep 1; done
    echo "no $1 steps after $2 s"; return 1
}

wait_job_gone() {   # wait_job_gone JOB SECONDS
    for _ in $(seq "$2"); do [ -z "$(on 0 squeue -h -j "$1" 2>/dev/null)" ] && return 0; sleep 1; done
    echo "job $1 still in the queue after $2 s"; on 0 squeue; return 1
}

submit() {
    on 0 sbatch --parsable "$W/job.sbatch"
}

scenario() {
    RUN=$W/runs/two
    # the script is written on node0 (the login node here): its interface travels in the script
    on 0 env GLOO_SOCKET_IFNAME=scnet "$PY" -m shardconsole --preset tiny-cpu --slurm --run-dir "$RUN" \
        --set parallel.nnodes=2 --set parallel.nproc_per_node=1 --set train.steps=100000 \
        --set train.log_every=1 --set train.checkpoint_every=20 --set fsdp.sharding=hybrid_shard > "$W/job.sbatch" || return 1
    grep '^#SBATCH' "$W/job.sbatch"

    echo "== 1. submit, then a plain scancel"
    job=$(submit); echo "job $job"
    wait_steps 25 300 || { tail -30 "$RUN"/slurm-*.out; return 1; }
    on 0 scancel "$job"
    wait_job_gone "$job" 90
    on 0 "$PY" -m shardconsole attach "$RUN" --headless 2>&1 | tail -3

    echo "== 2. resubmit: it resumes; then shardconsole stop from node0"
    before=$(steps_of)
    job=$(submit); echo "job $job"
    wait_steps $((before + 3)) 300 || { tail -30 "$RUN"/slurm-*.out; return 1; }
    on 0 "$PY" -m shardconsole stop "$RUN"
    wait_job_gone "$job" 90
    grep -h '"kind":"event"' "$RUN"/metrics*.jsonl | grep -o '"detail":"resumed from[^"]*"' | tail -1

    echo "== 3. resubmit, then node1 dies (kill -9 of everything in its namespace)"
    before=$(steps_of)
    job=$(submit); echo "job $job"
    wait_steps $((before + 3)) 300 || { tail -30 "$RUN"/slurm-*.out; return 1; }
    for pid in $(ip netns pids sc_n1); do kill -9 "$pid" 2>/dev/null; done
    # --requeue: Slurm puts the job back in the queue (pending until node1 returns) once it marks the node down
    for _ in $(seq 180); do [ "$(on 0 squeue -h -j "$job" -o %t 2>/dev/null)" != R ] && break; sleep 1; done
    on 0 "$PY" -m shardconsole attach "$RUN" --headless 2>&1 | tail -4
    on 0 sacct -j "$job" 2>/dev/null | tail -3
    on 0 scontrol show job "$job" 2>/dev/null | grep -E "JobState|Reason" | head -2
    requeued "$job"
}

requeued() {   # requeued JOB: node1 comes back; Slurm runs the requeued job, which resumes; a clean stop
    RUN=$W/runs/two
    echo "== 4. node1 back: the job Slurm requeued after the node failure runs again and resumes"
    start_slurmd 1
    sleep 3
    on 0 scontrol update NodeName=node1 State=RESUME 2>/dev/null   # ReturnToService=2 may have done it
    on 0 scontrol release "$1" 2>/dev/null
    before=$(steps_of)
    wait_steps $((before + 3)) 600 || { on 0 squeue; tail -30 "$RUN"/slurm-*.out; return 1; }
    grep -h '"kind":"event"' "$RUN"/metrics*.jsonl | grep -o '"detail":"resumed from[^"]*"' | tail -1
    echo "== 5. the clean stop: scancel --batch --signal=USR1"
    on 0 scancel --batch --signal=USR1 "$1"
    wait_job_gone "$1" 420
    on 0 "$PY" -m shardconsole attach "$RUN" --headless 2>&1 | tail -3
    on 0 sacct -j "$1" 2>/dev/null | tail -3
    echo "== leftovers of these runs (should be none):"; pgrep -af "$W/runs" || echo none
}

case "${1:-all}" in
    down) down ;;
    up) up ;;
    requeued) requeued "$2" ;;
    *) up && scenario; rc=$?; [ -n "${SC_KEEP:-}" ] || down; exit $rc ;;
esac
