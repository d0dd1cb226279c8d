"""Stand-in for a tutorial step in the SLURM tests: join the group, all-reduce ones, report.

Run by torchrun (inside slurm/*.sh). Each rank writes OUT_DIR/rank<R>.json with what the tests
check: world size, the all-reduced sum (= world size when every rank took part), and where it ran.
"""

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

# What the SLURM tests look at besides the sum: which node and which SLURM task started this rank.
ENV_KEYS = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_PROCID",
    "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "TORCHELASTIC_RUN_ID",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ones = torch.ones(4)
    dist.all_reduce(ones)  # sum over ranks: every element becomes world_size
    report = {
        "world_size": world_size,
        "sum": ones[0].item(),
        "rank": rank,
        "hostname": socket.gethostname(),
        "SLURMD_NODENAME": os.environ.get("SLURMD_NODENAME"),
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "torch_threads": torch.get_num_threads(),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()  # nobody leaves while a peer still talks to it
    dist.destroy_process_group()
    print(f"rank {rank}/{world_size} on {report['SLURMD_NODENAME']}: sum {report['sum']}")


if __name__ == "__main__":
    main()
