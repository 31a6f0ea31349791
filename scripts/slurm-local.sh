#!/usr/bin/env bash
# A one-node (or two-node) Slurm cluster on this host, for the tests of the Slurm profile
# (docs/workflow.md, "On a Slurm cluster"):
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
#
# PISFT_SLURM_NODES=2 (or more, up to 9): that many nodes, each a slurmd in its own network
# namespace, as a cluster's nodes are hosts of their own on one network (multi-node jobs: one
# launcher per node, a rendezvous across them):
#   - namespace, hostname and Slurm node name $NETNS-n<i> (PISFT_SLURM_NETNS, default pisft);
#     address $NET.<10+i>/24 on a veth pair whose other end is in a bridge, $NETNS-br, which holds
#     $NET.1, the controller's address (PISFT_SLURM_NET, default 10.213.57: a range no interface
#     here may use, checked before anything is made). No route leads anywhere else: the nodes reach
#     each other and the controller, nothing beyond.
#   - each slurmd runs in its own mount and UTS namespaces (`unshare --mount --uts`: private
#     mounts, its own hostname) entered into its network namespace (`nsenter --net`); there,
#     $DIR/etc is bind-mounted on /etc/slurm (where srun in a job
#     finds the configuration) and $DIR/etc/hosts on /etc/hosts (the nodes' and the controller's
#     names): nothing is written to this host's /etc. The filesystem is otherwise the host's, shared
#     as a cluster shares its network storage.
#   - its own munged on $DIR/run/munge.socket (AuthInfo), so that it neither uses nor disturbs a
#     one-node cluster's munged on munge's default socket; ports from PISFT_SLURM_PORT, default
#     16827 (+0..3), clear of the one-node cluster's.
#   - `stop` also ends what is left in each namespace (a job's processes), then deletes the
#     namespaces, the veth pairs and the bridge. `start-node I` starts node I's slurmd again (a
#     test that killed it: SlurmdTimeout=10 makes the node DOWN and its jobs NODE_FAIL in seconds;
#     ReturnToService=2 makes it idle again once its slurmd registers).
set -euo pipefail

DIR="${PISFT_SLURM_DIR:-/tmp/pisft-slurm}"
NODES="${PISFT_SLURM_NODES:-1}"
[[ "$NODES" =~ ^[1-9]$ ]] || { echo "slurm-local: PISFT_SLURM_NODES must be 1 to 9, got '$NODES'" >&2; exit 2; }
if [ "$NODES" = 1 ]; then PORT="${PISFT_SLURM_PORT:-16817}"; else PORT="${PISFT_SLURM_PORT:-16827}"; fi
PARTITION="${PISFT_SLURM_PARTITION:-pisft}"
NET="${PISFT_SLURM_NET:-10.213.57}"
NETNS="${PISFT_SLURM_NETNS:-pisft}"
BRIDGE="$NETNS-br"
if [ "$NODES" = 1 ]; then
  MUNGE_SOCKET=/run/munge/munge.socket.2  # munge's default, where Slurm looks
else
  MUNGE_SOCKET="$DIR/run/munge.socket"  # the cluster's own (AuthInfo in its configuration)
fi
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

# every node idle in sinfo
node_idle() {
  local states
  states="$(sinfo -h -N -o '%t' 2>/dev/null)" || return 1
  [ "$(grep -cx idle <<<"$states")" = "$NODES" ] && [ "$(wc -l <<<"$states")" = "$NODES" ]
}

# node_name I: the i-th node of a multi-node cluster (its namespace and hostname)
node_name() { echo "$NETNS-n$1"; }
node_addr() { echo "$NET.$((10 + $1))"; }

munge_ok() { munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

# The namespaces, veth pairs and bridge of a multi-node cluster (see the top of this file)
net_up() {
  local i node
  if ip -4 -o addr | grep -qF "inet $NET."; then
    ip -4 -o addr >&2
    die "the address range $NET.0/24 is in use on this host (above); set PISFT_SLURM_NET to the" \
        "first three numbers of a free /24"
  fi
  ip link show "$BRIDGE" >/dev/null 2>&1 \
    && die "a link named $BRIDGE exists; stop the cluster that made it ($0 stop with its" \
           "PISFT_SLURM_DIR) or set PISFT_SLURM_NETNS"
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for i in $(seq 1 "$NODES"); do
    node="$(node_name "$i")"
    ip netns add "$node"
    ip link add "$NETNS-v$i" type veth peer name "$NETNS-p$i"
    ip link set "$NETNS-p$i" netns "$node"
    ip link set "$NETNS-v$i" master "$BRIDGE" up
    ip -n "$node" addr add "$(node_addr "$i")/24" dev "$NETNS-p$i"
    ip -n "$node" link set "$NETNS-p$i" up
    ip -n "$node" link set lo up
  done
}

# what is left in the namespaces (a job's processes, by pid), then the namespaces and the bridge
net_down() {
  local i node pids
  for i in $(seq 1 9); do
    node="$(node_name "$i")"
    ip netns list 2>/dev/null | grep -qw "^$node" || continue
    pids="$(ip netns pids "$node" 2>/dev/null || true)"
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    ip netns del "$node" 2>/dev/null || true  # deletes its end of the veth pair, and so the pair
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE" || true
}

# start_node I: the i-th node's slurmd in its namespace, with its hostname, /etc/slurm and /etc/hosts
start_node() {
  local node
  node="$(node_name "$1")"
  mkdir -p "$DIR/spool/$node"
  # not `ip netns exec`, which remounts /sys for the namespace and so hides /sys/fs/cgroup, which
  # slurmd's cgroup plugin reads even under proctrack/linuxproc: a mount and UTS namespace of its
  # own (private mounts, unshare(1)'s default), entered into the node's network namespace
  start_daemon "slurmd-$node" unshare --mount --uts -- nsenter --net="/run/netns/$node" -- sh -c \
    'hostname "$1" && mount --bind "$2/hosts" /etc/hosts && mount --bind "$2" /etc/slurm && exec slurmd -D' \
    sh "$node" "$DIR/etc"
}

write_config() {
  local host node nodes ctld slurmd_files auth dbd_auth node_timeout i
  host="$(hostname -s)"
  # this host's real topology and memory, as slurmd sees it
  node="$(slurmd -C | head -n 1)"
  [[ "$node" == NodeName=* ]] || die "slurmd -C printed no node line: $node"
  if [ "$NODES" = 1 ]; then
    nodes="$node State=UNKNOWN"
    ctld="$host"
    slurmd_files="SlurmdSpoolDir=$DIR/spool
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmdLogFile=$DIR/log/slurmd.log"
    auth=""
    dbd_auth=""
    node_timeout=""
  else
    # every node the host's cores and memory (they share them), at its namespace's address
    nodes=""
    printf '127.0.0.1 localhost\n%s %s\n' "$NET.1" "$host" >"$DIR/etc/hosts"
    for i in $(seq 1 "$NODES"); do
      nodes+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") ${node#NodeName=* } State=UNKNOWN"$'\n'
      printf '%s %s\n' "$(node_addr "$i")" "$(node_name "$i")" >>"$DIR/etc/hosts"
    done
    ctld="$host($NET.1)"
    slurmd_files="SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log"
    # the socket for the daemons and commands (AuthInfo), and for the connections to slurmdbd
    # (AccountingStoragePass: slurm.conf(5), "the alternate socket name for use with a Munge daemon")
    auth="AuthInfo=socket=$MUNGE_SOCKET"
    # a node whose slurmd stops answering is DOWN after 10 s (default 300), its jobs NODE_FAIL
    node_timeout="SlurmdTimeout=10"
    dbd_auth="AccountingStoragePass=$MUNGE_SOCKET"
  fi
  cat >"$DIR/etc/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: a $NODES-node cluster for tests.
ClusterName=pisft
SlurmctldHost=$ctld
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
$slurmd_files
$auth
$node_timeout
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
$dbd_auth
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
$nodes
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
# Written by scripts/slurm-local.sh
AuthType=auth/munge
$auth
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
  if [ -f "$DIR/pids/slurmctld" ] && kill -0 "$(cat "$DIR/pids/slurmctld")" 2>/dev/null; then
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
  # the network first: the controller's address ($NET.1) exists before anything is sent to it
  [ "$NODES" = 1 ] || net_up

  # munge on its default socket: slurmd asks it before it has a configuration (configless), and
  # so do the commands in a job. A munged already serving this host is used as it is. Several
  # nodes: the cluster's own, on its own socket.
  if [ "$NODES" = 1 ] && munge_ok; then
    log "using the munged already running on $MUNGE_SOCKET"
  else
    [ -S "$MUNGE_SOCKET" ] && rm -f "$MUNGE_SOCKET"
    mkdir -p "$(dirname "$MUNGE_SOCKET")"
    mungekey --create --keyfile="$DIR/munge/munge.key" --force
    start_daemon munged munged --foreground --force --key-file="$DIR/munge/munge.key" \
      --socket="$MUNGE_SOCKET" --pid-file="$DIR/run/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    wait_for "munged" 30 munged munge_ok
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
  if [ "$NODES" = 1 ]; then
    start_daemon slurmd slurmd -D --conf-server "$(hostname -s):$PORT"
    wait_for "the node to be idle in sinfo" 60 slurmd node_idle
  else
    local i
    for i in $(seq 1 "$NODES"); do start_node "$i"; done
    wait_for "the $NODES nodes to be idle in sinfo" 60 "slurmd-$(node_name "$NODES")" node_idle
  fi
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
  local slurmds=(slurmd) i
  for i in $(seq 1 9); do slurmds+=("slurmd-$(node_name "$i")"); done
  for name in "${slurmds[@]}" slurmctld slurmdbd mariadbd munged; do
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
  [ "$NODES" = 1 ] || net_down
}

case "${1:-}" in
  start) start ;;
  stop) stop_all ;;
  start-node)
    # start-node I: the i-th node's slurmd again (after a test killed it), until every node is idle
    [ "$NODES" != 1 ] && [[ "${2:-}" =~ ^[1-9]$ ]] && [ "${2:-0}" -le "$NODES" ] \
      || die "usage: PISFT_SLURM_NODES=N $0 start-node I (1 <= I <= N, N > 1)"
    export PATH="$PATH:/usr/sbin:/sbin" SLURM_CONF="$DIR/etc/slurm.conf"
    start_node "$2"
    wait_for "the $NODES nodes to be idle in sinfo" 120 "slurmd-$(node_name "$2")" node_idle
    ;;
  env) echo "export SLURM_CONF=$DIR/etc/slurm.conf" ;;
  *) echo "usage: $0 start|stop|env|start-node I" >&2; exit 2 ;;
esac
