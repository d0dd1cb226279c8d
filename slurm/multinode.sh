#!/bin/bash
# Train on several nodes: one torchrun agent per node, which starts one worker process per GPU.
#
# Usage, from the repository root:
#   sbatch slurm/multinode.sh                           # runs 05_multinode.py
#   sbatch slurm/multinode.sh 05_multinode.py --epochs 3 # a step and its arguments
#   sbatch --nodes=4 slurm/multinode.sh                 # options on the command line beat #SBATCH lines
#   NPROC_PER_NODE=1 sbatch slurm/multinode.sh          # processes per node (see "How many workers")
# Watch it:  squeue --me    then    tail -f ddp-multinode-<job id>.out
#
# Classic mistakes, all of which this script avoids:
# - "# SBATCH" with a space is an ordinary comment: SLURM silently ignores it. Write "#SBATCH".
# - Two torchrun agents on one node (e.g. --ntasks-per-node=4 for 4 GPUs): every agent starts its
#   own --nproc-per-node workers, so 4 x 4 = 16 processes share 4 GPUs. One task per node.
# - "torchrun --nnodes 2 ..." without srun: this script runs on the first node only, so the second
#   node never starts an agent and the first waits for it until the rendezvous times out.
#
# The #SBATCH lines must come before the first command; sbatch stops reading them there.
#SBATCH --job-name=ddp-multinode
#SBATCH --nodes=2
# ONE task per node: that task is torchrun, and torchrun starts the workers.
#SBATCH --ntasks-per-node=1
# CPU cores for everything on the node (the one task holds them all): 2 for CPU runs. With GPUs
# turn on the --cpus-per-task line below the GPU line too (about 8 cores per GPU: each GPU's worker
# runs its Python loop and data loading on them); a later #SBATCH line of an option overrides this.
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
# %x = job name, %j = job id, in the folder you submitted from. A folder such as
# logs/%x-%j.out must exist before sbatch: SLURM does not create it, and the job fails without a log.
#SBATCH --output=%x-%j.out
#
# Common cluster variations: delete one '#' to turn a line on ("##SBATCH" is a plain comment).
# GPUs per node (older clusters: --gres=gpu:4), and about 8 cores per GPU: turn on both lines.
##SBATCH --gpus-per-node=4
##SBATCH --cpus-per-task=32
# The allocation your jobs are billed to (required on ComputeCanada/Alliance clusters).
##SBATCH --account=def-someone
# Which queue and which kind of node.
##SBATCH --partition=gpu
##SBATCH --constraint=a100
# Memory per node.
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
# ComputeCanada/Alliance: build the virtualenv on each node's local disk ($SLURM_TMPDIR is per
# node, so run it once on every node), then activate it here; srun passes PATH on to the tasks.
# srun --ntasks-per-node=1 bash -c 'virtualenv --no-download "$SLURM_TMPDIR/env" &&
#     "$SLURM_TMPDIR/env/bin/pip" install --no-index -r requirements.txt'
# source "$SLURM_TMPDIR/env/bin/activate"
#
# Default: the repository's own .venv, if there is one (it must be on a shared filesystem).
if [[ -f .venv/bin/activate ]]; then
    # shellcheck source=/dev/null
    source .venv/bin/activate
fi

# --- What to run: the arguments given to sbatch after this script, by default 05_multinode.py.
if (($# == 0)); then
    set -- 05_multinode.py
fi

# --- How many workers per node: one per GPU the job was given. SLURM sets SLURM_GPUS_ON_NODE when
# the job asked for GPUs (--gpus-per-node, --gres) and lists them, or their MIG instances, in
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

# --- CPU threads per worker: the node's cores shared by its workers (at least 1). Without this,
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

# --- Rendezvous: every agent meets at the first node of the job.
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
# Use the address SLURM itself uses for that node (its NodeAddr): a node's name in SLURM need not
# be a name the other nodes can resolve. On most clusters NodeAddr is the hostname or IP anyway.
HEAD_ADDR=$HEAD
if [[ "$(scontrol show node -o "$HEAD")" =~ NodeAddr=([^[:space:]]+) ]]; then
    HEAD_ADDR=${BASH_REMATCH[1]}
fi
# A port derived from the job id, so two jobs sharing a node do not pick the same one.
PORT=$((15000 + SLURM_JOB_ID % 15000))  # 15000-29999: below the ports Linux hands out itself (32768+)

# Network interfaces: if the nodes cannot connect although the address above is right, name the
# interface that reaches the other nodes (`ip -br addr` lists them; not docker0 or a management
# network). NCCL (GPUs) reads one variable and gloo another; gloo is used on GPU clusters too, by
# steps 08 and 09 for their background checkpoint saves. 05 on prints what each rank inherited.
# export NCCL_SOCKET_IFNAME=ib0
# export GLOO_SOCKET_IFNAME=ib0

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

echo "job $SLURM_JOB_ID: $SLURM_NNODES nodes ($SLURM_JOB_NODELIST) x $NPROC workers," \
    "OMP_NUM_THREADS=$OMP_NUM_THREADS, rendezvous at $HEAD_ADDR:$PORT, running: $*"

# --- Preemption and time limits (step 07). With "--signal=B:USR2@120" turned on (see the top),
# SLURM sends USR2 to this batch shell 120-180 s before the time limit. We pass it on as SIGTERM
# to the job step: torchrun forwards SIGTERM to its workers and kills them 30 s later
# (--shutdown-timeout); step 07's workers agree on a step within about a second, checkpoint
# there and exit. Then the job requeues itself, and the requeued run (SLURM_RESTART_COUNT > 0)
# resumes from that checkpoint. Other steps would start over: turn --signal on for step 07 only.
# (A USR2 sent to torchrun itself kills it and orphans its workers, unless torchrun was started
# with --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2: it then shuts its workers down
# with USR2, which 07 does not catch. Hence this shell's trap.) A preemption by the scheduler
# sends SIGTERM to the step directly, without this warning, then SIGKILL after KillWait (30 s
# by default); 07 saves the same way, and whether the job comes back is the cluster's policy.
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

# srun starts one task per node (= one torchrun agent per node). --kill-on-bad-exit=1: if one
# node's torchrun fails, SLURM stops the others instead of leaving them waiting until the time limit.
# c10d rendezvous: the agents find each other at HEAD_ADDR:PORT and number the nodes themselves,
# so no --node-rank is needed; --rdzv-id keeps two jobs from joining each other's group.
# It runs in the background so that this shell can run its USR2 trap while waiting.
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$NPROC" \
    --rdzv-backend c10d \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-endpoint "$HEAD_ADDR:$PORT" \
    "$@" &
SRUN_PID=$!
wait "$SRUN_PID"
