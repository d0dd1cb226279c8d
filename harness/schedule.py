"""The learning rate of every optimizer step: --lr, scaled to the global batch, warmed up,
decayed per epoch. Built by common.lr_schedule; 09's export rebuilds one to copy a checkpoint's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DECAY = 0.7  # per epoch: what StepLR(step_size=1, gamma=0.7), stepped once per epoch, did


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """--lr x warm-up(step) x 0.7 ** epoch, for the optimizer step counted from the run's first.

    Stepped after every optimizer.step(). The warm-up ramps the factor linearly from 1 (--lr
    itself) at the first step to `scale` after `warmup_steps` steps, then stays at `scale`
    (Goyal et al., 2017); every `steps_per_epoch` steps the rate is multiplied by 0.7. With
    scale 1 the factor is 0.7 ** epoch all epoch long: the per-epoch StepLR the steps used
    before the learning-rate scaling came.

    A checkpoint holds the steps taken and the steps per epoch they were counted in. Resumed
    with another number of steps per epoch (another world size, with --batch-per-rank), the
    count is converted to finished epochs + steps into the current one, so the rate still
    decays at epoch boundaries. The scale and warm-up are this run's flags; the checkpoint
    says where in the schedule it stopped, and the rate of the next step follows from both.
    """

    def __init__(self, optimizer, scale: float = 1.0, warmup_steps: int = 0,
                 steps_per_epoch: int = 1):
        self.steps_per_epoch = steps_per_epoch

        def factor(step: int) -> float:
            ramp = 1 + (scale - 1) * step / warmup_steps if step < warmup_steps else scale
            return ramp * DECAY ** (step // self.steps_per_epoch)

        super().__init__(optimizer, factor)

    def last_step_lr(self) -> float:
        """The rate of the last step taken (get_last_lr() is the next step's: after an epoch's
        last step, already the next epoch's)."""
        return self.base_lrs[0] * self.lr_lambdas[0](max(0, self.last_epoch - 1))  # 1 group

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
