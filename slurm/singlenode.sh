#!/bin/bash
# Train on one node: one torchrun, which starts one worker process per GPU.
#
# Usage, from the repository root:
#   sbatch slurm/singlenode.sh                           # runs 05_multinode.py (any step works)
#   sbatch slurm/singlenode.sh 03_ddp_wrapper.py --epochs 3  # a step and its arguments
#   NPROC_PER_NODE=1 sbatch slurm/singlenode.sh          # processes (see "How many workers")
# Watch it:  squeue --me    then    tail -f ddp-singlenode-<job id>.out
#
# Classic mistakes, all of which this script avoids:
# - "# SBATCH" with a space is an ordinary comment: SLURM silently ignores it. Write "#SBATCH".
# - Two torchrun agents on one node (e.g. --ntasks=4 for 4 GPUs): every agent starts its own
#   --nproc-per-node workers, so 4 x 4 = 16 processes share 4 GPUs. One task, one torchrun.
# - More than one node needs srun to start torchrun on each of them: see slurm/multinode.sh.
#
# The #SBATCH lines must come before the first command; sbatch stops reading them there.
#SBATCH --job-name=ddp-singlenode
#SBATCH --nodes=1
# ONE task: that task is torchrun, and torchrun starts the workers.
#SBATCH --ntasks=1
# CPU cores for everything (the one task holds them all): 2 for CPU runs. With GPUs turn on the
# --cpus-per-task line below the GPU line too (about 8 cores per GPU: each GPU's worker runs its
# Python loop and data loading on them); a later #SBATCH line of an option overrides this one.
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
# %x = job name, %j = job id, in the folder you submitted from. A folder such as
# logs/%x-%j.out must exist before sbatch: SLURM does not create it, and the job fails without a log.
#SBATCH --output=%x-%j.out
#
# Common cluster variations: delete one '#' to turn a line on ("##SBATCH" is a plain comment).
# GPUs (older clusters: --gres=gpu:4), and about 8 cores per GPU with them: turn on both lines.
##SBATCH --gpus-per-node=4
##SBATCH --cpus-per-task=32
# The allocation your jobs are billed to (required on ComputeCanada/Alliance clusters).
##SBATCH --account=def-someone
# Which queue and which kind of node.
##SBATCH --partition=gpu
##SBATCH --constraint=a100
# Memory for the job.
##SBATCH --mem=64G
# Step 07 uses this: SIGUSR2 to this batch script 120 s before the time limit, to save and requeue.
##SBATCH --signal=B:USR2@120
# A requeued job appends to its log instead of overwriting the first run's.
#SBATCH --open-mode=append

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
if [[ -n "${MAX_REQUEUES:-}" ]]; then
    check_count MAX_REQUEUES "$MAX_REQUEUES" 0  # (read in the trap, at the worst moment)
fi

# --- Software. Load your cluster's modules first, e.g.:
# module load python/3.11 cuda
#
# ComputeCanada/Alliance: build the virtualenv on the node's local disk, then use it.
# virtualenv --no-download "$SLURM_TMPDIR/env"
# source "$SLURM_TMPDIR/env/bin/activate"
# pip install --no-index -r requirements.txt
#
# Default: the repository's own .venv, if there is one.
if [[ -f .venv/bin/activate ]]; then
    # shellcheck source=/dev/null
    source .venv/bin/activate
fi

# --- What to run: the arguments given to sbatch after this script, by default 05_multinode.py.
if (($# == 0)); then
    set -- 05_multinode.py
fi

# --- How many workers: one per GPU the job was given. SLURM sets SLURM_GPUS_ON_NODE when the job
# asked for GPUs (--gpus-per-node, --gres) and lists them, or their MIG instances, in
# CUDA_VISIBLE_DEVICES; nvidia-smi -L would also count GPUs given to other jobs, and physical GPUs
# instead of MIG instances. No GPU: 2 CPU processes (gloo). NPROC_PER_NODE, set when you submit,
# overrides both (to use fewer GPUs, or another number of CPU processes).
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

# --- CPU threads per worker: the job's cores shared by its workers (at least 1). Without this,
# torchrun sets OMP_NUM_THREADS=1 for every worker and leaves the other cores idle.
CPUS=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
THREADS=$((CPUS / NPROC))
((THREADS >= 1)) || THREADS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
if ((GPUS > 0 && CPUS < 4 * NPROC)); then
    echo "warning: $CPUS CPU cores for $NPROC GPU workers starve their data loading and Python:" \
        "ask for about 8 per GPU (--cpus-per-task, see the top)" >&2
fi
# SLURM 22.05 to 23.02: srun does not inherit --cpus-per-task from the job (23.11 went back to
# inheriting it and ignores this variable): without this line the torchrun task, and all its
# workers, would be squeezed onto one core there.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi

# --- When a GPU run hangs or dies: NCCL's warnings, and each rank's Flight Recorder (its last
# collectives), written when NCCL's watchdog times out, into a folder on the shared filesystem
# (fr-<job id> in the submit folder, which every node sees): read them with torchfrtrace
# (docs/debugging.md).
# The TORCH_FR_* names are torch 2.15's; older torch reads the TORCH_NCCL_* ones.
if ((GPUS > 0)); then
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000} TORCH_FR_DUMP_ON_TIMEOUT=1
    export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$SLURM_SUBMIT_DIR/fr-$SLURM_JOB_ID/rank_}
    export TORCH_NCCL_TRACE_BUFFER_SIZE=$TORCH_FR_BUFFER_SIZE TORCH_NCCL_DUMP_ON_TIMEOUT=1
    export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$TORCH_FR_DUMP_TEMP_FILE
    mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"
fi

# If you add torchrun --max-restarts: a restarted group must meet at a fresh store, not at the one
# the dead group left its addresses in (pytorch/pytorch#135712). Harmless without restarts.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

echo "job $SLURM_JOB_ID: 1 node ($SLURM_JOB_NODELIST) x $NPROC workers," \
    "OMP_NUM_THREADS=$OMP_NUM_THREADS, running: $*"

# --- Preemption and time limits (step 07). With "--signal=B:USR2@120" turned on (see the top),
# SLURM sends USR2 to this batch shell 120 s before the time limit. We pass it on as SIGTERM
# to the job step: torchrun forwards SIGTERM to its workers (a USR2 would kill torchrun itself
# and orphan them), and step 07's workers agree on a step, checkpoint there and exit. Then the
# job requeues itself, and the requeued run (SLURM_RESTART_COUNT > 0) resumes from that
# checkpoint. Other steps would start over: turn --signal on for step 07 only. A preemption by
# the scheduler sends SIGTERM to the step directly, without this warning (07 saves the same
# way); whether the job then comes back is the cluster's policy (--requeue asks for it).
MAX_REQUEUES=${MAX_REQUEUES:-10}
checkpoint_and_requeue() {
    echo "$(date +%T) USR2: time limit or preemption near; the workers checkpoint and stop"
    scancel --signal=TERM "$SLURM_JOB_ID"  # every step of this job, but not this shell
    wait "$SRUN_PID" || true
    if ((${SLURM_RESTART_COUNT:-0} < MAX_REQUEUES)); then
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit 0
}
trap checkpoint_and_requeue USR2

# srun makes torchrun a job step: SLURM tracks it, passes it the job's cores and signals, and
# --kill-on-bad-exit=1 ends the job as soon as it fails. --standalone: a private rendezvous on
# this node at a free port, so nothing to choose and no clash with another job on the node.
# It runs in the background so that this shell can run its USR2 trap while waiting.
srun --kill-on-bad-exit=1 torchrun \
    --standalone \
    --nnodes 1 \
    --nproc-per-node "$NPROC" \
    "$@" &
SRUN_PID=$!
wait "$SRUN_PID"
