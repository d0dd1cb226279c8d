#!/bin/bash
# One-minute sanity check before a long job: can every node of the job start Python with torch,
# see its GPUs, and join one process group with all the others?
#
# Usage, from the repository root:
#   sbatch slurm/check.sh                           # 2 nodes, runs 01_torch_dist_allreduce.py
#   sbatch --nodes=4 --gpus-per-node=4 slurm/check.sh
#   NPROC_PER_NODE=1 sbatch slurm/check.sh          # CPU processes per node when there is no GPU
# Then read ddp-check-<job id>.out: one line per node, then one all-reduce result per process.
#
# The launch is the one in slurm/multinode.sh (read its comments first): one torchrun per node
# through srun, rendezvous at the first node's address. If this job works, so does that one.
#
#SBATCH --job-name=ddp-check
#SBATCH --nodes=2
# ONE task per node: that task is torchrun, and torchrun starts the workers.
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
# Short: a check that hangs should fail fast, and short jobs often start sooner.
#SBATCH --time=00:05:00
#SBATCH --output=%x-%j.out
#
# Delete one '#' to turn a line on, as in slurm/multinode.sh.
##SBATCH --gpus-per-node=4
##SBATCH --cpus-per-task=32
##SBATCH --account=def-someone
##SBATCH --partition=gpu

set -euo pipefail
: "${SLURM_JOB_ID:?submit this script with sbatch, see Usage at the top}"

# Numbers you may set when you submit (NPROC_PER_NODE=...): checked first, so that a bad one is
# one line naming it, not bash's own "division by 0" or "unbound variable" further down.
check_count() {  # NAME VALUE LOWEST: a whole number, at least LOWEST
    if ! [[ $2 =~ ^(0|[1-9][0-9]{0,5})$ ]] || (($2 < $3)); then
        echo "error: $1=$2 is not allowed: it must be a whole number" \
            "(digits, no leading 0) of at least $3" >&2
        exit 2
    fi
}
if [[ -n "${NPROC_PER_NODE:-}" ]]; then
    check_count NPROC_PER_NODE "$NPROC_PER_NODE" 1
fi

# --- Software: the same as in slurm/multinode.sh (module load, $SLURM_TMPDIR virtualenv, ...).
if [[ -f .venv/bin/activate ]]; then
    # shellcheck source=/dev/null
    source .venv/bin/activate
fi

if (($# == 0)); then
    set -- 01_torch_dist_allreduce.py
fi

# --- Workers per node, threads, cores for srun: as in slurm/multinode.sh.
GPUS=${SLURM_GPUS_ON_NODE:-0}
if ((GPUS == 0)) && [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "$CUDA_VISIBLE_DEVICES" != NoDevFiles ]]; then
    IFS=, read -ra GIVEN <<<"$CUDA_VISIBLE_DEVICES"  # the GPUs (or MIG instances) SLURM gave us
    GPUS=${#GIVEN[@]}
fi
NPROC=$GPUS
if [[ -z "$NPROC" || "$NPROC" == 0 ]]; then
    NPROC=2
fi
NPROC=${NPROC_PER_NODE:-$NPROC}
CPUS=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
THREADS=$((CPUS / NPROC))
((THREADS >= 1)) || THREADS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
HEAD_ADDR=$HEAD
if [[ "$(scontrol show node -o "$HEAD")" =~ NodeAddr=([^[:space:]]+) ]]; then
    HEAD_ADDR=${BASH_REMATCH[1]}
fi
PORT=$((15000 + SLURM_JOB_ID % 15000))  # 15000-29999: below the ports Linux hands out itself (32768+)

echo "job $SLURM_JOB_ID: nodes ${NODES[*]}, $NPROC workers per node, rendezvous at $HEAD_ADDR:$PORT"

# One line per node (--label puts the task number first): SLURM's name for the node, its hostname,
# the CPU cores this task may use, torch, and the GPUs torch sees. A node missing here, an old
# torch, "cpus 1" where you asked for more (SLURM 22.05-23.02: SRUN_CPUS_PER_TASK), or "cuda False" on a GPU node is
# the problem to fix before anything else.
echo "--- each node: SLURM name, hostname, cores, torch, GPUs"
srun --label python -c '
import os, socket, torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(os.environ["SLURMD_NODENAME"], socket.gethostname(), "cpus", len(os.sched_getaffinity(0)),
      "torch", torch.__version__, "cuda", torch.cuda.is_available(), len(gpus), gpus, flush=True)'

echo "--- all-reduce across $SLURM_NNODES nodes x $NPROC workers"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$NPROC" \
    --rdzv-backend c10d \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-endpoint "$HEAD_ADDR:$PORT" \
    "$@"
echo "--- check passed"
