#!/usr/bin/env bash
# A one-node Slurm cluster on this host, for the tests of the Slurm profile (docs/workflow.md,
# "On a Slurm cluster"):
#   scripts/slurm-local.sh start   install what is missing (Debian's slurm-wlm 22.05, slurmdbd,
#                                  munge, mariadb-server; as root), write the configuration, start
#                                  munged, MariaDB, slurmdbd, slurmctld and slurmd; exits 0 once
#                                  `sinfo` shows the node idle
#   scripts/slurm-local.sh stop    stop every daemon `start` started, by its pid (newest first)
#   scripts/slurm-local.sh env     the line to source for Slurm's clients: export SLURM_CONF=...
# Everything (configuration, state, spool, logs, database, munge key) lives in
# PISFT_SLURM_DIR (default /tmp/pisft-slurm); nothing under /etc is written, so clients find the
# cluster through SLURM_CONF. Ports PISFT_SLURM_PORT..+3 (default 16817: slurmctld, slurmd,
# slurmdbd, MariaDB) stay clear of a real installation's 6817-6819 and 3306.
# The node is this host with its real cores and memory (`slurmd -C`), in one partition,
# PISFT_SLURM_PARTITION (default pisft). It declares the gres types gpu and npu but has none, so
# an accelerator request is refused at submission, as on a site whose nodes lack them.
# No cgroups: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, SlurmUser=root.
set -euo pipefail

DIR="${PISFT_SLURM_DIR:-/tmp/pisft-slurm}"
PORT="${PISFT_SLURM_PORT:-16817}"
PARTITION="${PISFT_SLURM_PARTITION:-pisft}"
MUNGE_SOCKET=/run/munge/munge.socket.2  # munge's default, where Slurm looks
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)
# the program each package provides (a missing one: install the package)
PROGRAMS=(slurmctld slurmdbd munged mariadbd)
PROGRAMS_BESIDE=(slurmd sbatch sacct sinfo munge unmunge mungekey mariadb-install-db mariadb)

die() { echo "slurm-local: $*" >&2; exit 1; }
log() { echo "slurm-local: $*" >&2; }

install_missing() {
  local missing=0 prog
  for prog in "${PROGRAMS[@]}" "${PROGRAMS_BESIDE[@]}"; do
    command -v "$prog" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$prog" >/dev/null 2>&1 || missing=1
  done
  [ "$missing" = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "Slurm's packages (${PACKAGES[*]}) are missing and installing them needs root: run as root, or apt-get install them first"
  command -v apt-get >/dev/null || die "Slurm's packages (${PACKAGES[*]}) are missing and this host has no apt-get: install Slurm 22.05, slurmdbd, munge and MariaDB by hand"
  log "installing ${PACKAGES[*]} (apt-get)"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >"$DIR/apt.log" 2>&1; then
    apt-get update -q >>"$DIR/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >>"$DIR/apt.log" 2>&1 \
      || die "apt-get install ${PACKAGES[*]} failed; see $DIR/apt.log"
  fi
}

# start NAME CMD...: run a daemon in the foreground in its own session, record its pid
start_daemon() {
  local name="$1"; shift
  setsid "$@" >>"$DIR/log/$name.out" 2>&1 </dev/null &
  echo $! >"$DIR/pids/$name"
}

# wait_for WHAT SECONDS CMD...: until CMD succeeds; the daemon's log when it does not
wait_for() {
  local what="$1" seconds="$2" name="$3"; shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$(cat "$DIR/pids/$name")" 2>/dev/null; then
      tail -n 20 "$DIR/log/$name"* >&2 || true
      die "$name exited before $what; its log is above ($DIR/log/)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 20 "$DIR/log/$name"* >&2 || true
      die "timed out after ${seconds}s waiting for $what; the log is above ($DIR/log/)"
    fi
    sleep 0.5
  done
}

node_idle() { [ "$(sinfo -h -N -o '%t' 2>/dev/null)" = idle ]; }

write_config() {
  local host node
  host="$(hostname -s)"
  # this host's real topology and memory, as slurmd sees it
  node="$(slurmd -C | head -n 1)"
  [[ "$node" == NodeName=* ]] || die "slurmd -C printed no node line: $node"
  cat >"$DIR/etc/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: a one-node cluster for tests.
ClusterName=pisft
SlurmctldHost=$host
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu,npu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$((PORT + 2))
AccountingStorageTRES=gres/gpu,gres/npu
JobCompType=jobcomp/none
# sacct's Comment column: the plugin puts the rule's name there (rule_<name>)
AccountingStoreFlags=job_comment
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
KillWait=5
OverTimeLimit=0
InactiveLimit=0
MinJobAge=300
# configless: slurmd fetches this file from slurmctld and keeps it in /run/slurm/conf, where
# commands in a job find it (the plugin's job step drops SLURM_CONF before its srun)
SlurmctldParameters=enable_configless
$node State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
# Written by scripts/slurm-local.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=pisft-local
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
}

mysql_client() { mariadb --no-defaults -S "$DIR/mysql/mysql.sock" -uroot "$@"; }

start() {
  if [ -f "$DIR/pids/slurmd" ] && kill -0 "$(cat "$DIR/pids/slurmd")" 2>/dev/null; then
    export SLURM_CONF="$DIR/etc/slurm.conf"
    node_idle && { log "already running ($DIR)"; return 0; }
  fi
  [ "$(id -u)" = 0 ] || die "the local cluster runs its daemons as root (SlurmUser=root); run as root"
  mkdir -p "$DIR"
  export PATH="$PATH:/usr/sbin:/sbin"
  install_missing
  stop_all quiet
  rm -rf "$DIR"/{etc,state,spool,run,log,munge,mysql,pids}
  mkdir -p "$DIR"/{etc,state,spool,run,log,munge,mysql,pids}
  chmod 700 "$DIR/munge"
  export SLURM_CONF="$DIR/etc/slurm.conf"
  write_config
  local t0=$SECONDS

  # munge on its default socket: slurmd asks it before it has a configuration (configless), and
  # so do the commands in a job. A munged already serving this host is used as it is.
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "using the munged already running on $MUNGE_SOCKET"
  else
    [ -S "$MUNGE_SOCKET" ] && rm -f "$MUNGE_SOCKET"
    mkdir -p "$(dirname "$MUNGE_SOCKET")"
    mungekey --create --keyfile="$DIR/munge/munge.key" --force
    start_daemon munged munged --foreground --force --key-file="$DIR/munge/munge.key" \
      --socket="$MUNGE_SOCKET" --pid-file="$DIR/run/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    wait_for "munged" 30 munged sh -c 'munge -n | unmunge'
  fi

  mariadb-install-db --no-defaults --datadir="$DIR/mysql/data" --user=root \
    --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 \
    || { tail -n 20 "$DIR/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  start_daemon mariadbd mariadbd --no-defaults --user=root --datadir="$DIR/mysql/data" \
    --socket="$DIR/mysql/mysql.sock" --port=$((PORT + 3)) --bind-address=127.0.0.1 \
    --skip-name-resolve --pid-file="$DIR/run/mariadbd.pid" --log-error="$DIR/log/mariadbd.log" \
    --innodb-buffer-pool-size=64M --innodb-log-file-size=16M
  wait_for "MariaDB" 60 mariadbd mysql_client -e "SELECT 1"
  mysql_client -e "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'pisft-local';
                   GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

  start_daemon slurmdbd slurmdbd -D
  wait_for "slurmdbd" 60 slurmdbd sacctmgr -n list cluster
  sacctmgr -i add cluster pisft >/dev/null
  sacctmgr -i add account pisft Description=tests Organization=pisft >/dev/null
  sacctmgr -i add user root DefaultAccount=pisft >/dev/null

  start_daemon slurmctld slurmctld -D -i
  wait_for "slurmctld" 60 slurmctld scontrol ping
  start_daemon slurmd slurmd -D --conf-server "$(hostname -s):$PORT"
  wait_for "the node to be idle in sinfo" 60 slurmd node_idle
  log "up in $((SECONDS - t0))s: partition $PARTITION, $(sinfo -h -N -o '%N %c CPUs %m MB %t'); export SLURM_CONF=$SLURM_CONF"
}

# stop_all [quiet]: SIGTERM to each daemon started here, newest first, then SIGKILL after 20 s
stop_all() {
  local name pid deadline
  # the jobs first: slurmstepd outlives slurmd, a job left running would too
  if [ -f "$DIR/pids/slurmctld" ] && kill -0 "$(cat "$DIR/pids/slurmctld")" 2>/dev/null; then
    export SLURM_CONF="$DIR/etc/slurm.conf"
    scancel --user="$(id -un)" 2>/dev/null || true
    deadline=$((SECONDS + 30))
    while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
  fi
  for name in slurmd slurmctld slurmdbd mariadbd munged; do
    [ -f "$DIR/pids/$name" ] || continue
    pid="$(cat "$DIR/pids/$name")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      deadline=$((SECONDS + 20))
      while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
      [ "${1:-}" = quiet ] || log "stopped $name ($pid)"
    fi
    rm -f "$DIR/pids/$name"
  done
  # slurmd's link to its configuration cache (configless), if it points here
  case "$(readlink /run/slurm/conf 2>/dev/null)" in "$DIR"/*) rm -f /run/slurm/conf ;; esac
}

case "${1:-}" in
  start) start ;;
  stop) stop_all ;;
  env) echo "export SLURM_CONF=$DIR/etc/slurm.conf" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
