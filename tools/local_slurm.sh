#!/usr/bin/env bash
# A real Slurm cluster on this one host: munge, MariaDB + slurmdbd (accounting: `sacct`, which
# NeMo-Run polls for a job's state), one slurmctld and NODES slurmd daemons (`slurmd -N n1`,
# `-N n2`, ...), each a "node" with its own port, spool, log and pid file.
# Debian's slurm-wlm, slurmdbd, mariadb-server and munge are installed when missing (root only).
#
#   tools/local_slurm.sh up      install if needed, start what is not running, wait until idle
#   tools/local_slurm.sh down    stop every daemon this script started (the state dir stays)
#   tools/local_slurm.sh status  sinfo, or exit 1 when the cluster is not up
#   tools/local_slurm.sh env     the SLURM_CONF line a shell needs to reach the cluster
#
# Idempotent: `up` twice leaves one set of daemons; `down` when nothing runs succeeds.
# Settings (environment): NVRX_SLURM_DIR (state, default /var/tmp/nvrx-slurm),
# NVRX_SLURM_NODES (3), NVRX_SLURM_CPUS (CPUs each node claims, 4),
# NVRX_SLURM_PORT (slurmctld's port, 16817; slurmdbd PORT-1; node i listens on PORT+i).
# Jobs find the cluster through SLURM_CONF=$NVRX_SLURM_DIR/slurm.conf; /etc/slurm is not touched.
set -euo pipefail

DIR=${NVRX_SLURM_DIR:-/var/tmp/nvrx-slurm}
NODES=${NVRX_SLURM_NODES:-3}
CPUS=${NVRX_SLURM_CPUS:-4}
PORT=${NVRX_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf
DBD_PORT=$((PORT - 1))
DB_SOCKET=$DIR/mysql.sock
PACKAGES="slurm-wlm slurmdbd mariadb-server munge"
export SLURM_CONF=$CONF

die() { echo "local_slurm: $*" >&2; exit 1; }

install_packages() {
  local cmd missing=0
  for cmd in slurmctld slurmd slurmdbd munged sbatch mariadbd; do command -v $cmd >/dev/null || missing=1; done
  [ $missing = 0 ] && return
  [ "$(id -u)" = 0 ] || die "missing packages; only root can install them (apt-get install $PACKAGES)"
  command -v apt-get >/dev/null || die "missing packages and no apt-get to install them ($PACKAGES)"
  echo "local_slurm: installing $PACKAGES" >&2
  apt-get update -qq >/dev/null
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PACKAGES >/dev/null || die "apt-get install $PACKAGES failed"
}

node_names() { local i; for i in $(seq 1 "$NODES"); do echo "n$i"; done; }

write_conf() {
  mkdir -p "$DIR/ctld" "$DIR/log"
  local host; host=$(hostname -s)
  local tmp=$CONF.tmp
  {
    echo "# written by tools/local_slurm.sh"
    echo "ClusterName=nvrx"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$DIR/ctld"
    echo "SlurmdSpoolDir=$DIR/spool-%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=sched_interval=2"
    echo "MpiDefault=none"
    echo "JobRequeue=1"
    echo "ReturnToService=2"
    echo "SlurmdParameters=config_overrides"
    echo "JobCompType=jobcomp/none"
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=localhost"
    echo "AccountingStoragePort=$DBD_PORT"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=30"
    echo "InactiveLimit=0"
    echo "KillWait=10"
    echo "MinJobAge=300"
    echo "MessageTimeout=10"
    echo "UnkillableStepTimeout=60"
    local i
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=2000 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } > "$tmp"
  mv "$tmp" "$CONF"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  local sock=/run/munge/munge.socket.2
  if [ -S "$sock" ] && munge -n </dev/null >/dev/null 2>&1; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  [ -s /etc/munge/munge.key ] || {
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  }
  runuser -u munge -- /usr/sbin/munged
  wait_for "munge" 30 munge_works
}

munge_works() { munge -n </dev/null >/dev/null 2>&1; }

wait_for() {  # what, seconds, command...
  local what=$1 limit=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || die "$what did not come up within ${limit}s (logs: $DIR/log)"
    sleep 0.2
  done
}

write_dbd_conf() {
  local tmp=$DIR/slurmdbd.conf.tmp
  {
    echo "# written by tools/local_slurm.sh"
    echo "AuthType=auth/munge"
    echo "DbdHost=localhost"
    echo "DbdPort=$DBD_PORT"
    echo "SlurmUser=root"
    echo "PidFile=$DIR/slurmdbd.pid"
    echo "LogFile=$DIR/log/slurmdbd.log"
    echo "StorageType=accounting_storage/mysql"
    echo "StorageHost=localhost"
    echo "StorageLoc=slurm_acct_db"
    echo "StorageUser=root"
  } > "$tmp"
  chmod 600 "$tmp"
  mv "$tmp" "$DIR/slurmdbd.conf"
}

db_answers() { mariadb --socket="$DB_SOCKET" -u root -e "select 1" >/dev/null 2>&1; }

start_database() {
  db_answers && return
  if [ ! -d "$DIR/mysql/mysql" ]; then
    mkdir -p "$DIR/mysql"
    mariadb-install-db --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
      >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $DIR/log/mariadb-install.log)"
  fi
  # --skip-networking: slurmdbd reaches it through the socket that StorageHost=localhost means
  mkdir -p /run/mysqld
  mariadbd --user=root --datadir="$DIR/mysql" --socket="$DB_SOCKET" --pid-file="$DIR/mariadb.pid" \
    --skip-networking --log-error="$DIR/log/mariadb.log" >/dev/null 2>&1 &
  wait_for "mariadb" 60 db_answers
  ln -sf "$DB_SOCKET" /run/mysqld/mysqld.sock
}

dbd_answers() { sacctmgr -n -P list cluster >/dev/null 2>&1; }

start_slurmdbd() {
  write_dbd_conf
  if ! alive "$DIR/slurmdbd.pid"; then
    slurmdbd 2>>"$DIR/log/slurmdbd.stderr" \
      || die "slurmdbd did not start (see $DIR/log)"
  fi
  wait_for "slurmdbd" 60 dbd_answers
  sacctmgr -n -P list cluster format=cluster | grep -qx nvrx || sacctmgr -i add cluster nvrx >/dev/null
}

ctld_answers() { scontrol ping 2>/dev/null | grep -q "is UP"; }

all_idle() {
  local states; states=$(sinfo -h -N -o "%N %T" 2>/dev/null) || return 1
  local n
  for n in $(node_names); do
    echo "$states" | grep -qE "^$n (idle|mixed|allocated)" || return 1
  done
}

up() {
  install_packages
  start_munge
  write_conf
  start_database
  start_slurmdbd
  if ! alive "$DIR/slurmctld.pid"; then
    slurmctld -f "$CONF" -c 2>>"$DIR/log/slurmctld.stderr" || die "slurmctld did not start (see $DIR/log)"
  fi
  wait_for "slurmctld" 60 ctld_answers
  local n
  for n in $(node_names); do
    if ! alive "$DIR/slurmd-$n.pid"; then
      mkdir -p "$DIR/spool-$n"
      slurmd -f "$CONF" -N "$n" 2>>"$DIR/log/slurmd-$n.stderr" || die "slurmd -N $n did not start (see $DIR/log)"
    fi
    # a node brought back after `down` or a test's kill comes back DOWN until told otherwise
    scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
  done
  wait_for "the nodes" 90 all_idle
  sinfo -N
}

stop_pidfile() {
  local pidfile=$1
  alive "$pidfile" || { rm -f "$pidfile"; return; }
  local pid; pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + 30))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

down() {
  [ -f "$CONF" ] || return 0
  scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
  local f
  for f in "$DIR"/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
  stop_pidfile "$DIR/slurmctld.pid"
  stop_pidfile "$DIR/slurmdbd.pid"
  stop_pidfile "$DIR/mariadb.pid"
  return 0
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) ctld_answers || die "not up (SLURM_CONF=$CONF)"; sinfo -N ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: $0 up|down|status|env" ;;
esac
