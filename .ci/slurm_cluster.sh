#!/usr/bin/env bash
# Single-machine Slurm "cluster" for Debian 12 (slurm-wlm 22.05) without systemd, so that CI can
# submit `strata launch --slurm` jobs for real (tests/launch/test_slurm.py): several slurmd "nodes" on
# this one host, all with NodeAddr=127.0.0.1, each advertising fake GPUs (a GRES count with no
# device files) so that `--gpus-per-node` requests schedule on a CPU-only machine.
#
# Usage:  slurm_cluster.sh [start|stop|restart|status|test|purge]   (run as root)
#   env:  SLURM_NODES=N     number of slurmd "nodes" on this host (default 2: one slurmd per
#                           NodeName n1..nN, distinct ports; tell them apart in a job by
#                           $SLURMD_NODENAME, since they share the hostname)
#         SLURM_GPUS=N      fake GPUs (gres/gpu count, no device files) per node (default 1)
#         SLURM_ACCT=dbd|none  dbd (default): also install mariadb + slurmdbd so that plain
#                           `sacct -j ID` works.  none: no DB; plain sacct says "Slurm
#                           accounting storage is disabled", but `sacct -c -j ID` (reads the
#                           jobcomp/filetxt file) still reports COMPLETED/FAILED per run.
#         SLURM_CPUS=N      CPUs advertised per node (default: topology from `slurmd -C`)
#         SLURM_REQUEUE_EXIT=42[,43]  add RequeueExit= (jobs exiting so are requeued)
#         SLURM_CRED_EXPIRE=10  requeued-job restart delay (slurm default 120)
#         SLURM_MINJOBAGE=4     secs a finished job stays in squeue/scontrol; also makes
#                           `sbatch --wait` poll every 2s (large values => 2,8,32s polls)
#
# Idempotent: `start` installs what is missing, rewrites config, and (re)starts only
# daemons that are not running.  `stop` kills all daemons it started.
set -euo pipefail

MODE=${1:-start}
NODES=${SLURM_NODES:-2}
GPUS=${SLURM_GPUS:-1}
ACCT=${SLURM_ACCT:-dbd}
HOST=$(hostname -s)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
SPOOL=/var/spool/slurm
LOGDIR=/var/log/slurm
RUNDIR=/run/slurm
CLUSTER=local
BASE_PORT=17001        # slurmd ports: 17001, 17002, ...
export DEBIAN_FRONTEND=noninteractive

log() { printf '[slurm_cluster %s] %s\n' "$(date +%T)" "$*" >&2; }

node_names() { local i; for ((i = 1; i <= NODES; i++)); do printf 'n%d ' "$i"; done; }

# true if the pid file names a live (non-zombie) process
pid_alive() {
  local pid st
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ -n $st && $st != Z && $st != X ]]
}

install_pkgs() {
  local want=(slurmctld slurmd slurm-client munge)
  [[ $ACCT == dbd ]] && want+=(slurmdbd mariadb-server)
  local missing=()
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    # package lists may be empty on a fresh container
    if ! apt-cache show "${missing[0]}" >/dev/null 2>&1 || [[ ! -d /var/lib/apt/lists ]] \
       || [[ -z $(ls /var/lib/apt/lists 2>/dev/null | grep -v lock) ]]; then
      apt-get update -qq
    fi
    # postinst scripts try invoke-rc.d; policy-rc.d / no systemd makes that a no-op.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

setup_munge() {
  install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  install -d -o munge -g munge -m 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then   # Debian's postinst normally creates one
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if ! pid_alive /run/munge/munged.pid; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
  fi
  local i
  for ((i = 0; i < 50; i++)); do munge -n </dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "munge does not work"; return 1
}

setup_mariadb_slurmdbd() {
  [[ $ACCT == dbd ]] || return 0
  install -d -o mysql -g mysql /run/mysqld
  if ! pid_alive /run/mysqld/mysqld.pid; then
    log "starting mariadbd"
    # --skip-grant-tables is NOT used: root@localhost auth is unix_socket by default.
    (cd / && exec setsid -f /usr/sbin/mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid \
        --socket=/run/mysqld/mysqld.sock --bind-address=127.0.0.1 \
        --innodb-buffer-pool-size=64M </dev/null >>/var/log/mariadbd.log 2>&1)
    local i
    for ((i = 0; i < 100; i++)); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmdbpass';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  cat >$CONF_DIR/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$LOGDIR/slurmdbd.log
PidFile=$RUNDIR/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurmdbpass
EOF
  chmod 0600 $CONF_DIR/slurmdbd.conf
  if ! pid_alive $RUNDIR/slurmdbd.pid; then
    log "starting slurmdbd"
    /usr/sbin/slurmdbd
    local i
    for ((i = 0; i < 100; i++)); do (echo >/dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.2; done
  fi
}

write_conf() {
  CONF_CHANGED=0
  install -d -m 0755 $CONF_DIR $SPOOL $SPOOL/ctld $LOGDIR $RUNDIR
  local c detected cpus mem
  detected=$(slurmd -C | head -1)      # NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105
  if [[ -n ${SLURM_CPUS:-} ]]; then
    cpus="CPUs=$SLURM_CPUS"
  else  # full topology, e.g. "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1"
    cpus=$(grep -o 'CPUs=.*ThreadsPerCore=[0-9]*' <<<"$detected")
  fi
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$detected")
  # Advertise a bit less memory than detected, else node may drain ("Low RealMemory").
  # With several slurmd on one host each node gets an equal share (memory is not enforced).
  mem=$(( mem * 9 / 10 / NODES ))
  local acct_lines
  if [[ $ACCT == dbd ]]; then
    acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
  else
    acct_lines="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
  fi
  c=$(mktemp)
  cat >"$c" <<EOF
# generated by slurm_cluster.sh
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also = how long a requeued job waits before it may start again (default 120s)
AuthInfo=cred_expire=${SLURM_CRED_EXPIRE:-10}
CryptoType=crypto/munge
MpiDefault=none
SlurmctldPort=6817
SlurmctldPidFile=$RUNDIR/slurmctld.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdPidFile=$RUNDIR/slurmd-%n.pid
SlurmdLogFile=$LOGDIR/slurmd-%n.log
SlurmdSpoolDir=$SPOOL/d-%n
StateSaveLocation=$SPOOL/ctld
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# fast re-scheduling of requeued/held jobs on a tiny test cluster (defaults 30/60s)
SchedulerParameters=bf_interval=2,sched_interval=5
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=${SLURM_MINJOBAGE:-4}
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
SlurmctldDebug=info
SlurmdDebug=info
$acct_lines
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log
EOF
  # jobs exiting with one of these codes are requeued automatically (e.g. SLURM_REQUEUE_EXIT=42)
  [[ -n ${SLURM_REQUEUE_EXIT:-} ]] && echo "RequeueExit=$SLURM_REQUEUE_EXIT" >>"$c"
  local i
  for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((BASE_PORT + i - 1)) $cpus RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN" >>"$c"
  done
  # The fake GPUs: gres/gpu ignores a gres.conf line without File=, and wants character devices
  # there; these have /dev/null's numbers (nothing constrains devices: TaskPlugin=task/none).
  local g i
  install -d -m 0755 $RUNDIR/fake-gpu
  for ((i = 0; i < GPUS; i++)); do
    [[ -c $RUNDIR/fake-gpu/gpu$i ]] || mknod -m 0666 $RUNDIR/fake-gpu/gpu$i c 1 3
  done
  g=$(mktemp)
  printf 'NodeName=n[1-%d] Name=gpu File=%s/fake-gpu/gpu[0-%d]\n' "$NODES" "$RUNDIR" "$((GPUS - 1))" >"$g"
  if ! cmp -s "$g" $CONF_DIR/gres.conf; then
    mv "$g" $CONF_DIR/gres.conf; chmod 0644 $CONF_DIR/gres.conf; CONF_CHANGED=1
  else
    rm -f "$g"
  fi
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$c"
  if ! cmp -s "$c" $CONF; then
    mv "$c" $CONF; chmod 0644 $CONF; CONF_CHANGED=1
  else
    rm -f "$c"
  fi
}

start_slurm() {
  if ((CONF_CHANGED)) && { compgen -G "$RUNDIR/slurmd-*.pid" >/dev/null || [[ -f $RUNDIR/slurmctld.pid ]]; }; then
    # node set may have changed => `scontrol reconfigure` is not enough, restart slurm daemons
    log "config changed: restarting slurm daemons"; stop_slurm_only
  fi
  if ! pid_alive $RUNDIR/slurmctld.pid; then
    log "starting slurmctld"
    /usr/sbin/slurmctld     # daemonizes; -i would ignore saved state on version mismatch
  fi
  local n
  for n in $(node_names); do
    if ! pid_alive $RUNDIR/slurmd-$n.pid; then
      install -d -m 0755 $SPOOL/d-$n
      log "starting slurmd -N $n"
      /usr/sbin/slurmd -N "$n"
    fi
  done
  # wait for nodes to register; resume any that came back DOWN/DRAIN from an earlier run
  local i st bad
  for ((i = 0; i < 150; i++)); do
    st=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
    if [[ -n $st ]] && ! grep -qvE ' (idle|mix|alloc)$' <<<"$st"; then break; fi
    # DOWN/DRAIN left over from an earlier run (or set by hand): resume them
    # (resume must name only nodes that are down/drained, else the whole request fails)
    bad=$(awk '$2 ~ /^(down|drain|drng|drained|fail)$/ {print $1}' <<<"$st" | paste -sd,)
    [[ -n $bad ]] && scontrol update nodename="$bad" state=resume 2>/dev/null || true
    sleep 0.2
  done
  ((i < 150)) || log "WARNING: not all nodes idle after 30s (see $LOGDIR/slurmd-*.log, sinfo -R)"
  sinfo -N
}

# kill the daemons named by the given pid files in parallel: TERM, wait <=10s, then KILL
kill_pidfiles() {
  local f pid pids=() i
  for f in "$@"; do
    pid=$(cat "$f" 2>/dev/null) || continue
    [[ -n $pid ]] && kill "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$f"
  done
  for ((i = 0; i < 100; i++)); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

stop_slurm_only() { kill_pidfiles $RUNDIR/slurmd-*.pid $RUNDIR/slurmctld.pid; }

stop_all() {
  # cancel jobs still known to slurmctld so that no slurmstepd is left behind
  if pid_alive $RUNDIR/slurmctld.pid && [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
    squeue -h -o %i | xargs -r scancel 2>/dev/null || true
    local i; for ((i = 0; i < 30; i++)); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
  fi
  stop_slurm_only
  kill_pidfiles $RUNDIR/slurmdbd.pid /run/mysqld/mysqld.pid /run/munge/munged.pid
  # leftover slurmstepd processes of killed jobs
  local pid; for pid in $(pgrep -x slurmstepd || true); do kill -9 "$pid" 2>/dev/null || true; done
  log "stopped"
}

status() {
  local f
  for f in /run/munge/munged.pid /run/mysqld/mysqld.pid $RUNDIR/slurmdbd.pid $RUNDIR/slurmctld.pid $RUNDIR/slurmd-*.pid; do
    [[ -f $f ]] || continue
    if pid_alive "$f"; then echo "running: $f ($(cat "$f"))"; else echo "dead:    $f"; fi
  done
  sinfo -N 2>/dev/null || true
}

selftest() {
  local d; d=$(mktemp -d /tmp/slurmtest.XXXX); cd "$d"
  log "test: sbatch --wait trivial job"
  local t0=$SECONDS id
  id=$(sbatch --parsable --wait -N1 -o out.%j --wrap 'srun hostname; echo ok')
  log "job $id done in $((SECONDS - t0))s: $(tr '\n' ' ' <out.$id)"
  if [[ $ACCT == dbd ]]; then
    sacct -j "$id" -X -n --format=JobID,State,ExitCode
  else
    sacct -c -j "$id" -n --format=JobID,State,ExitCode
  fi
  if ((NODES > 1)); then
    id=$(sbatch --parsable --wait -N"$NODES" -o out.%j --wrap 'srun -l hostname; echo $SLURM_JOB_NODELIST')
    log "multi-node job $id: $(tr '\n' ' ' <out.$id)"
  fi
}

case $MODE in
  start)
    t0=$EPOCHREALTIME
    install_pkgs
    t1=$EPOCHREALTIME
    setup_munge
    write_conf
    setup_mariadb_slurmdbd
    start_slurm
    t2=$EPOCHREALTIME
    log "$(awk -v a=$t0 -v b=$t1 -v c=$t2 'BEGIN{printf "install/check: %.1fs, daemons start->nodes idle: %.1fs", b-a, c-b}')"
    ;;
  stop) stop_all ;;
  restart) stop_all; "$0" start ;;
  status) status ;;
  test) selftest ;;
  purge) stop_all; rm -rf $SPOOL $LOGDIR $CONF $CONF_DIR/slurmdbd.conf ;;
  *) echo "usage: $0 [start|stop|restart|status|test|purge]" >&2; exit 2 ;;
esac
