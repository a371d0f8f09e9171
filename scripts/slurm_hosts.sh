#!/usr/bin/env bash
# Host discovery for elastic mode under Slurm (MPI_GRADREDUCER_ELASTIC_DISCOVERY): the nodes of this job's
# allocation (SLURM_JOB_NODELIST, expanded by scontrol) that Slurm reports usable now, one a line: idle,
# mixed, allocated or completing, and responding. A node that is down, failing, drained or draining is left
# out, so that replacements start on the others. Each node gets MPI_GRADREDUCER_ELASTIC_SLOTS slots (set it
# to the tasks per node; default 1).
set -euo pipefail
usable=$(sinfo --noheader --Node --responding --format="%N %t" | awk '$2 ~ /^(idle|mix|alloc|comp)$/ {print $1}')
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  if grep -qx "$node" <<<"$usable"; then
    echo "$node"
  fi
done
