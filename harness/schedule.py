"""The learning rate of every optimizer step: --lr, scaled to the global batch, warmed up,
decayed per epoch. Built by common.lr_schedule; 09's export rebuilds one to copy a checkpoint's.
"""

from __future__ import annotations

import torch.distributed as dist

import common

DECAY = 0.7  # per epoch (common.LRSchedule)


class LRSchedule(common.LRSchedule):
    """common.LRSchedule, resumable on another number of steps per epoch and with another --lr.

    A checkpoint holds the steps taken and the steps per epoch they were counted in. Resumed
    with another number of steps per epoch (another world size, with --batch-per-rank), the
    count is converted to finished epochs + steps into the current one, so the rate still
    decays at epoch boundaries. The scale and warm-up are this run's flags; the checkpoint
    says where in the schedule it stopped, and the rate of the next step follows from both.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        epochs, step = divmod(state_dict["last_epoch"], state_dict["steps_per_epoch"])
        saved_lrs = state_dict.get("base_lrs", self.base_lrs)
        # --lr is this run's flag too: the checkpoint's own rate would be used silently, while
        # summary.json records --lr (issue 43). Same rate: nothing changes, the resume is exact.
        super().load_state_dict({**state_dict, "steps_per_epoch": self.steps_per_epoch,
                                 "last_epoch": epochs * self.steps_per_epoch + step,
                                 "base_lrs": self.base_lrs})
        if saved_lrs != self.base_lrs and (not dist.is_initialized() or dist.get_rank() == 0):
            saved = saved_lrs[0] if isinstance(saved_lrs, list) and saved_lrs else saved_lrs
            print(f"note: --lr {self.base_lrs[0]:g} replaces the --lr {saved} the checkpoint "
                  f"was trained with; the schedule goes on from its step {self.last_epoch}",
                  flush=True)
        # The next step's rate, from this run's scale (the optimizer's state held the old one).
        self._last_lr = [base * factor(self.last_epoch)
                         for factor, base in zip(self.lr_lambdas, self.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
