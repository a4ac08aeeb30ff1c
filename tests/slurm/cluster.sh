#!/usr/bin/env bash
# A one-node SLURM cluster with accounting, for the SLURM tests (run as root; Debian packages
# slurm-wlm, slurmdbd, munge, mariadb-server). Usage: cluster.sh start|stop <state dir>
# Daemons are stopped by PID; state, logs and the database live under <state dir>.
set -euo pipefail
cmd=$1 dir=$2
host=$(hostname)
pids=("$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/slurmdbd.pid" /run/mysqld/dflash.pid "$dir/munged.pid")

stop() {
  for f in "${pids[@]}"; do
    [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null || true
  done
  # Only this test's daemons run on a CI machine: make sure none survives (ports, sockets).
  for name in slurmd slurmctld slurmdbd mariadbd munged; do pkill -x "$name" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for name in slurmd slurmctld slurmdbd mariadbd munged; do pgrep -x "$name" >/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.2
  done
  for name in slurmd slurmctld slurmdbd mariadbd munged; do pkill -9 -x "$name" 2>/dev/null || true; done
  # With a slurm.conf naming a controller that is gone, every `scontrol show config` waits
  # 9 s for it, and the Snakemake SLURM plugin runs one each time Snakemake starts (it reads
  # MinJobAge): every later `snakemake` call of the suite would start 9 s late. Without one,
  # scontrol fails at once, as on a machine that never ran this cluster.
  rm -f /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf "$dir/started"
}

wait_for() {  # wait_for <seconds> <command...>
  local n=$1; shift
  for _ in $(seq $((n * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "timed out waiting for: $*" >&2; return 1
}

start() {
  stop
  mkdir -p "$dir"/{state,spool,log} /etc/slurm /run/munge /run/mysqld /run/mysqld/dflash-db
  chown munge:munge /run/munge; chown mysql:mysql /run/mysqld /run/mysqld/dflash-db
  [[ -f /etc/munge/munge.key ]] || mungekey --create
  /usr/sbin/munged --pid-file="$dir/munged.pid" --force
  mariadb-install-db --user=mysql --datadir=/run/mysqld/dflash-db >"$dir/log/dbinit.log" 2>&1
  (mariadbd --user=mysql --datadir=/run/mysqld/dflash-db --socket=/run/mysqld/dflash.sock --port=3307 \
     --bind-address=127.0.0.1 --pid-file=/run/mysqld/dflash.pid >"$dir/log/mysqld.log" 2>&1 &)
  wait_for 30 mariadb --socket=/run/mysqld/dflash.sock -uroot -e "SELECT 1"
  mariadb --socket=/run/mysqld/dflash.sock -uroot -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  cat >/etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurmpw
PidFile=$dir/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
CONF
  chmod 600 /etc/slurm/slurmdbd.conf
  cat >/etc/slurm/slurm.conf <<CONF
ClusterName=dflash
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ReturnToService=2
MinJobAge=86400
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
# getconf, not nproc: nproc obeys OMP_NUM_THREADS, which each pytest-xdist worker sets to 1
NodeName=$host CPUs=$(getconf _NPROCESSORS_ONLN) RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  /usr/sbin/slurmdbd
  wait_for 30 sacctmgr -n list cluster
  sacctmgr -i add cluster dflash >/dev/null 2>&1 || true
  sacctmgr -i add account default >/dev/null 2>&1 || true
  sacctmgr -i add user root account=default >/dev/null 2>&1 || true
  /usr/sbin/slurmctld
  /usr/sbin/slurmd
  wait_for 30 bash -c "sinfo -h -o %T | grep -q idle"
  touch "$dir/started"  # the test run stops the cluster at its end (tests/conftest.py)
}

"$cmd"
