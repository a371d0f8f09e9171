#!/usr/bin/env bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=10
# One MPI job in a Slurm allocation, started by the mpiexec of a venv's MPI (MPICH's Hydra or Open MPI 5's
# PRRTE), which reads the allocation from Slurm itself: no host list, no rank count. Every rank runs the
# venv's python with the arguments given:
#
#   sbatch --nodes 2 --ntasks-per-node 2 scripts/slurm_mpiexec.sh .venv scripts/seed_example.py
#
# With ELASTIC_RANKS=N (Open MPI only), the job is elastic (mpiexec --with-ft ulfm: ULFM needs mpiexec, not
# srun): N ranks train, and the rest of the allocation is room for replacements, which elastic mode finds
# with scripts/slurm_hosts.sh (the allocation's nodes that Slurm reports usable) and starts there when
# ranks are lost:
#
#   ELASTIC_RANKS=4 sbatch --nodes 3 --ntasks-per-node 2 scripts/slurm_mpiexec.sh .venv-ompi train.py
#
# With TCP_SUBNET (e.g. 198.18.0.0/24) and TCP_IFACE (e.g. eth0) set, MPI between nodes goes over TCP on that
# network only (as on scripts/cluster.py's hosts, which share one machine's memory). With SHARED_CORES=1
# (those hosts share its cores too), Open MPI's idle ranks yield their core instead of polling. Run as
# root, Open MPI is given its consent to that.
set -euo pipefail
venv=$1
shift
cd "${SLURM_SUBMIT_DIR:-.}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
options=()
if "$venv/bin/mpiexec" --version 2>&1 | grep -q "Open MPI\|PRRTE"; then
  options+=(--bind-to none)  # nodes that share cores: no pinning
  if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  if [ "${SHARED_CORES:-0}" = 1 ]; then
    export OMPI_MCA_mpi_yield_when_idle=1
  fi
  if [ -n "${TCP_SUBNET:-}" ]; then
    # PRRTE (Open MPI 5) reads PRTE_MCA_*; Open MPI before 5 read OMPI_MCA_orte_*
    export PRTE_MCA_oob_tcp_if_include=$TCP_SUBNET OMPI_MCA_btl_tcp_if_include=$TCP_SUBNET
    export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,sm,tcp
  fi
  if [ -n "${ELASTIC_RANKS:-}" ]; then
    options+=(--with-ft ulfm -n "$ELASTIC_RANKS")
    export MPI_GRADREDUCER_ELASTIC_DISCOVERY=$PWD/scripts/slurm_hosts.sh
    export MPI_GRADREDUCER_ELASTIC_SLOTS=${SLURM_NTASKS_PER_NODE:-1}
    export MPI_GRADREDUCER_ELASTIC_MAX_SIZE=${MPI_GRADREDUCER_ELASTIC_MAX_SIZE:-$ELASTIC_RANKS}
  fi
elif [ -n "${ELASTIC_RANKS:-}" ]; then
  echo "slurm_mpiexec: ELASTIC_RANKS needs Open MPI's mpiexec (ULFM); $venv/bin/mpiexec is another MPI's" >&2
  exit 2
elif [ -n "${TCP_IFACE:-}" ]; then
  export UCX_TLS=tcp,self UCX_NET_DEVICES=$TCP_IFACE  # MPICH over UCX: TCP between nodes
fi
echo "slurm_mpiexec: job $SLURM_JOB_ID, nodes $SLURM_JOB_NODELIST, tasks per node $SLURM_TASKS_PER_NODE:" \
  "$venv/bin/mpiexec ${options[*]} $venv/bin/python $*"
exec "$venv/bin/mpiexec" "${options[@]}" "$venv/bin/python" "$@"
