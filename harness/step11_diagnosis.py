"""What step 11 prints in the repository, and the files it writes there.

A planted mistake that raises: torch's message, then a "diagnosis:" line that names the fix. A
silent one, or --fix: the largest difference of each kind between the DDP model and the one
process (step11_your_model.py), the samples each rank drew, then the diagnosis or "all fixes
hold", and checks.json with the numbers (for the tests and docs/your-model.md). Files are
written atomically, a failure (a full disk) in one line.
"""

from __future__ import annotations

import json
import re

import torch

from .checkpoint import write_atomically, write_failure
from .errors import UserError

# N ranks vs one process over the same global batch, float32: the same sums in another order
# (the all-reduced BatchNorm statistics, DDP's averaged gradients). How far that rounding goes
# is the CPU's: 1.2e-7 in the gradients on this project's AMD EPYC VM, 6.6e-4 on an Intel Xeon
# (issue 59). So no fixed number bounds it: the control (the same steps, each micro-batch's
# samples in reverse order: step11_your_model.py) measures it where the step runs, and a check
# holds where the DDP model is within TIMES x the control's difference + ABSOLUTE of the
# reference: train_template.py's rule (its compare()). ABSOLUTE is for a control that rounds as
# the reference does (the running statistics: 0 to 1.5e-8, the ranks' 1.2e-7 to 1.8e-7, from
# the hand-written BatchNorm): 1e-6, a few last bits of the largest numbers compared (logits of
# up to 2-4: 2.4e-7 a bit), 190x under the smallest difference a planted mistake measured
# (1.9e-4, clip's running statistics; the rest 1.2e-3 and more). torch 2.14.1, 2 to 4 ranks.
TIMES, ABSOLUTE = 10, 1e-6
CHECKS = ("outputs", "gradients", "running statistics", "weights")
EXIT_MISTAKE = 4  # the planted mistake showed: torch raised, or a check measured it
RAISES = {"unused": "Expected to have finished reduction in the prior iteration",
          "checkpointing": "Expected to mark a variable ready only once",
          "save": "Error(s) in loading state_dict"}


def save_atomically(state: dict, path) -> None:
    """torch.save to a temporary file, then a rename: a reader never sees half a file."""
    write_in_one_line(path, lambda f: torch.save(state, f))


def write_in_one_line(path, write) -> None:
    """write_atomically, and a failure (a full disk: OSError, or torch.save's RuntimeError) as
    one line: the file is whole or as it was."""
    try:
        write_atomically(path, write)
    except (OSError, RuntimeError) as err:
        raise UserError(f"could not write {path}: {write_failure(err, path)}") from None


def explain(err: BaseException, bug: str) -> str:
    """torch's message as it prints it (indented, without a C++ source location), then the
    diagnosis line for the planted mistake that raised it."""
    text = re.sub(r"^\[[^\]]*\.cpp:\d+\] ", "", str(err).strip())
    message = "\n".join("    " + line.rstrip() for line in text.splitlines() if line.strip())
    return message + "\ndiagnosis: " + {
        "unused": f"DDP still waited for the gradients of {unused_names(err)} (the auxiliary "
                  f"head, unused in the step before) when the next forward began: pass "
                  f"find_unused_parameters=True, or static_graph=True when the same "
                  f"parameters are unused in every step",
        "checkpointing": f"reentrant checkpointing hid the block from DDP's search for unused "
                         f"parameters, so {ready_twice(err)} was marked ready twice: "
                         f"checkpoint(..., use_reentrant=False)",
        "save": "the file holds the DDP wrapper's state dict, whose keys start with "
                "'module.': save model.module.state_dict() and load it with weights_only=True",
    }[bug]


def unused_names(err: BaseException) -> str:
    """The parameters DDP names under TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL), else their
    indices (all DDP says at the default, OFF)."""
    names = re.search(r"Parameters which did not receive grad for rank \d+: (.+)", str(err))
    if names:
        return names[1].strip()
    indices = re.search(r"Parameter indices which did not receive grad for rank \d+: (.+)",
                        str(err))
    return f"parameter indices {indices[1].strip()}" if indices else "some parameters"


def ready_twice(err: BaseException) -> str:
    """The parameter DDP saw marked ready twice (torch 2.15 names it even at OFF)."""
    found = re.search(r"with name (\S+) has been marked as ready twice", str(err))
    return found[1] if found else "a parameter"


def write_checks(path, results: dict) -> None:
    """The measured numbers, for the tests and for docs/your-model.md."""
    write_in_one_line(path, lambda f: f.write(json.dumps(results, indent=1).encode()))


def bounds(one_process) -> dict:
    """Each check's bound: TIMES x the control's difference (the rounding) + ABSOLUTE."""
    return {kind: TIMES * one_process.rounding[kind] + ABSOLUTE for kind in CHECKS}


def report(one_process, sampled, reloaded, run, args) -> bool:
    """Rank 0: each check's measured number, then the diagnosis; True if any check failed."""
    found, rounding, n = one_process.found, one_process.rounding, run.world_size
    bound = bounds(one_process)
    for kind in CHECKS:
        print(f"check {kind}: {n} ranks vs one process over the global batch, {args.steps} "
              f"steps: largest difference {found[kind]:.3g} (rounding {rounding[kind]:.3g}, "
              f"bound {bound[kind]:.3g})")
    print(f"check running statistics between ranks: largest difference "
          f"{found['between ranks']:.3g}")
    print(f"check samples: each rank drew {sampled['per_rank']}; {sampled['shared_by_rank_0']} "
          f"of rank 0's were drawn by another rank too; {sampled['distinct']} distinct of "
          f"{sampled['per_rank'] * n}")
    print(f"check save: the reloaded plain model's outputs differ by {reloaded:g}")
    unequal = [kind for kind in CHECKS if not found[kind] <= bound[kind]]
    overlapping = sampled["shared_by_rank_0"] > 0
    write_checks(args.out_dir / "checks.json", {
        "bug": args.bug, "world_size": n, "steps": args.steps, **found, "rounding": rounding,
        "bound": bound, "norms": one_process.norms, **sampled, "reloaded": reloaded,
        "unequal": unequal})
    norms = ", ".join(f"{x:.2f}" for x in one_process.norms)
    rule = f"{TIMES}x the rounding + {ABSOLUTE:g}"
    if args.bug in ("batchnorm", "clip") and not unequal:  # the measurement decides, not --bug
        print(f"diagnosis: none measured: --bug {args.bug} is planted, yet {n} ranks equal one "
              f"process within rounding ({rule}: gradients {found['gradients']:.3g}, bound "
              f"{bound['gradients']:.3g}; weights {found['weights']:.3g}, bound "
              f"{bound['weights']:.3g})" + (
                  f": clipping never bit (global norms {norms}, --max-norm "
                  f"{args.max_norm:g}); a lower --max-norm shows the mistake"
                  if args.bug == "clip" else ""))
        return False
    if args.bug == "sampler":
        print(f"diagnosis: no DistributedSampler: {sampled['shared_by_rank_0']} of the "
              f"{sampled['per_rank']} samples rank 0 drew were drawn by the other ranks too "
              f"(all {n} ranks trained on {sampled['distinct']} distinct samples, not "
              f"{sampled['per_rank'] * n}): give the loader a DistributedSampler")
    elif args.bug == "batchnorm":
        print(f"diagnosis: per-rank BatchNorm: outputs differ from one process by "
              f"{found['outputs']:.3g}, gradients by {found['gradients']:.3g}, running "
              f"statistics by {found['running statistics']:.3g} (rank against rank "
              f"{found['between ranks']:.3g}): nn.SyncBatchNorm.convert_sync_batchnorm on "
              f"GPUs, all-reduced statistics (AllReducedBatchNorm) on the CPU")
    elif args.bug == "clip":
        print(f"diagnosis: clipping inside the micro-batch loop: gradients differ from one "
              f"process's clipped step by {found['gradients']:.3g}, weights by "
              f"{found['weights']:.3g} (global norms {norms}, clipped to "
              f"{args.max_norm:g}): clip once, after the last backward")
    else:
        if unequal or overlapping or reloaded != 0:
            print("error: a fix did not hold: " + ("; ".join(
                f"{kind} {found[kind]:.3g} from one process's (bound {bound[kind]:.3g})"
                for kind in unequal) or "samples or save"))
            return True
        print(f"all fixes hold: {n} ranks equal one process over the global batch within "
              f"rounding ({rule} in each of outputs, gradients, running statistics, weights; "
              f"global norms {norms}, clipped to {args.max_norm:g}); the ranks' samples are "
              f"disjoint; the saved model reloads bit for bit")
        return False
    return True
