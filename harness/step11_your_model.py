"""Step 11's one-process replay: what proves its fixes in the repository.

Rank 0 keeps a copy of the model and trains it the way one process would: on the global batch
(every rank's micro-batches, gathered in rank order), with plain BatchNorm over all of it and
the gradient clipped once. That step is train_template.py's replay, the one its --check takes.
After each step the DDP model's outputs, gradients, BatchNorm running statistics and weights
are compared with the copy's; the largest difference of each kind is what the step reports
(step11_diagnosis.py prints it), beside its rounding: a second copy, the control, takes the
same steps with each global micro-batch's samples in reverse order, and how far it lands from
the first is what float32 rounding alone gives on this machine (the template's --check has a
control too: the ranks in reverse order). The mistakes and their fixes are all in 11_your_model.py,
which runs copied out without this module; in the repository `take_in(step)` (twins.py) wraps
its functions:

- parse_flags: the --out-dir is checked for room first (a full disk is one line before any work);
  DEFAULTS draws the built-in synthetic digits (offline, in seconds; a copy reads MNIST);
- training_loader: the loader also yields each sample's index (which samples each rank drew);
- synchronise_batchnorm: the one-process copy is taken first, with plain BatchNorm;
- train_step: its outputs (a forward hook) and the gradients the optimizer applies (a step
  pre-hook) are compared with the copy's step on the gathered batch;
- train_step, save_and_reload: torch's error from a planted mistake is quoted, then a
  "diagnosis:" line, and every rank exits 4 (EXIT_MISTAKE);
- save_model: written atomically, a failure one line; show_result: the checks, then the
  diagnosis (exit 4), or "all fixes hold" (a fix that did not: exit 1).
A stop signal (SIGTERM) ends 11 at once, in one line: it has nothing to checkpoint.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import train_template as template  # the repository's root, as common.py: its replay

from .checkpoint import check_room
from .errors import stop_signals_end_now
from .ranks import all_ranks_agree, log
from .step11_diagnosis import CHECKS, EXIT_MISTAKE, RAISES, explain, report, save_atomically


class WithIndex(Dataset):
    """The dataset's samples, each with its index: to check which samples each rank drew."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return (*self.dataset[index], index)

    def __getitems__(self, indices):  # a whole batch at once, as harness/data.py's Digits does
        return [(*item, i) for item, i in zip(self.dataset.__getitems__(indices), indices)]


def gather(tensor: torch.Tensor, run) -> list[torch.Tensor]:
    """Every rank's `tensor` (the same shape on every rank), in rank order, on every rank."""
    tensor = tensor.to(run.device).contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(run.world_size)]
    dist.all_gather(pieces, tensor)
    return pieces


def gradients(model) -> list[torch.Tensor]:
    """A copy of every gradient, zero for a parameter that has none (an unused head)."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


def running_statistics(model) -> torch.Tensor:
    """BatchNorm's running means and variances, as one vector."""
    return torch.cat([b.detach().flatten() for name, b in model.named_buffers()
                      if name.endswith(("running_mean", "running_var"))])


def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


class OneProcess:
    """Rank 0's two copies of the model, each trained as one process over the global batch by
    train_template.py's own replay (one implementation of it: the template's --check runs the
    same): the reference joins each micro-batch from the ranks' samples in rank order, the
    control takes them in reverse order, the last rank's last sample first (as right, rounded
    otherwise: the rounding this machine's float32 kernels give the same step; every sample
    reversed, not the ranks alone, so that ranks that drew the same samples, --bug sampler,
    still sum in another order). `found` holds the largest difference from the DDP model to the
    reference seen so far, per kind; `rounding`, the control's."""

    def __init__(self, model, loss_of, lr: float, max_norm: float, run):
        self.run, self.loss_of, self.max_norm = run, loss_of, max_norm
        self.found = dict.fromkeys(CHECKS, 0.0)
        self.found["between ranks"] = 0.0  # running statistics, rank against rank
        self.rounding = dict.fromkeys(CHECKS, 0.0)  # the control against the reference
        self.norms = []  # the one-process gradient norm of each step, before clipping
        if run.is_main:
            self.twins = []  # the reference, the control: (model, optimizer, schedule)
            for _ in range(2):
                twin = copy.deepcopy(model)
                optimizer = torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9)
                self.twins.append((twin, optimizer,
                                   torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)))

    def step(self, twin, gathered, micro_batches: int, with_aux: bool, reverse: bool):
        """One optimizer step of `twin` over every rank's batch (`gathered`: [images, labels]
        per rank, in rank order), as template.replay takes it, each micro-batch's samples in
        reverse order if `reverse`; returns the outputs (micro-batch by micro-batch, in rank
        order), the clipped gradients, and the norm before clipping."""
        outputs, norms, clip = [], [], torch.nn.utils.clip_grad_norm_

        def loss(model, batch):  # 11's loss, in the template's place: (a sum, its samples)
            logits, aux = model(batch[0], with_aux=with_aux)
            outputs.append(logits.detach())
            return self.loss_of(logits, aux, batch[1]) * len(batch[1]), len(batch[1])

        def clip_and_note(*args, **kwargs):  # the norm before clipping, for the report
            norm = clip(*args, **kwargs)
            norms.append(norm.item())
            return norm

        order = (lambda t: t.flip(0)) if reverse else (lambda t: t)
        template.batch_loss, torch.nn.utils.clip_grad_norm_ = loss, clip_and_note
        try:
            batches = [[order(torch.cat([rank[k].chunk(micro_batches)[i] for rank in gathered]))
                        for k in range(2)] for i in range(micro_batches)]  # micro-batch major
            ran = template.replay(*twin, batches, self.max_norm)
        finally:
            torch.nn.utils.clip_grad_norm_ = clip
        return ([order(out) for out in outputs],
                [ran["gradients"].get(name, torch.zeros_like(p))  # (an unused head)
                 for name, p in twin[0].named_parameters()], norms)

    def compare(self, raw_model, micro_batches, outputs, grads, with_aux: bool) -> None:
        """Every rank's batch and outputs gathered; rank 0 takes the one-process step on them,
        twice (reference, control), and records how far the DDP model is from the reference,
        and the control (a collective: every rank calls)."""
        gathered = [list(batch) for batch in zip(*(gather(torch.cat(part), self.run) for part in
                                                   zip(*micro_batches)))]  # [images, labels]
        ddp_outputs = [torch.cat(gather(out, self.run)) for out in outputs]  # as replay orders
        stats = gather(running_statistics(raw_model), self.run)
        if not self.run.is_main:
            return
        n = self.run.world_size
        (ref_outputs, ref_grads, norms), (ctl_outputs, ctl_grads, _) = (
            self.step(twin, gathered, len(micro_batches), with_aux, reverse)
            for twin, reverse in zip(self.twins, (False, True)))
        self.norms += norms
        reference, control = (twin[0] for twin in self.twins)
        found = {"outputs": largest(ddp_outputs, ref_outputs),
                 "gradients": largest(grads, ref_grads),
                 "running statistics": largest(stats, [running_statistics(reference)] * n),
                 "weights": largest(list(raw_model.parameters()),
                                    list(reference.parameters())),
                 "between ranks": largest(stats[1:], stats[:1] * (n - 1))}
        rounding = {"outputs": largest(ctl_outputs, ref_outputs),
                    "gradients": largest(ctl_grads, ref_grads),
                    "running statistics": largest([running_statistics(control)],
                                                  [running_statistics(reference)]),
                    "weights": largest(list(control.parameters()),
                                       list(reference.parameters()))}
        for kind, value in found.items():
            self.found[kind] = max(self.found[kind], value)
        for kind, value in rounding.items():
            self.rounding[kind] = max(self.rounding[kind], value)


def overlap(indices: torch.Tensor, run) -> dict:
    """How many of the samples rank 0 drew some other rank drew too (a collective)."""
    everyone = gather(indices, run)
    others = torch.cat(everyone[1:]).unique()
    shared = torch.isin(everyone[0], others).sum().item()
    return {"per_rank": len(indices), "shared_by_rank_0": shared,
            "distinct": len(torch.cat(everyone).unique())}


# ---------------------------------------------------------------- the twins of 11's functions
TWINS = ("parse_flags", "training_loader", "synchronise_batchnorm", "train_step",
         "save_and_reload", "save_model", "show_result")


def take_in(step: dict) -> None:
    """Wrap 11's functions (this module's docstring says how and why)."""
    stop_signals_end_now()  # from the main thread, before main() runs
    step["DEFAULTS"] = {**step["DEFAULTS"], "data": "synthetic"}
    replay = Replay(step)
    for name in TWINS:
        step[name] = getattr(replay, name)


class Drawn:
    """The step's loader over WithIndex(dataset): yields (images, labels), keeps the indices."""

    def __init__(self, loader):
        self.loader, self.seen = loader, []

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for images, labels, indices in self.loader:
            self.seen.append(indices)
            yield images, labels


class Replay:
    """One run of 11: its plain functions, and what the twins learn on the way."""

    def __init__(self, step: dict):
        self.step, self.plain = step, {name: step[name] for name in TWINS}

    def parse_flags(self):
        args = self.plain["parse_flags"]()
        check_room(args.out_dir)  # where the model goes: a full disk is one line now
        return args

    def training_loader(self, train_set, run, args, plan):
        self.run, self.args = run, args
        self.loader = Drawn(self.plain["training_loader"](WithIndex(train_set), run, args, plan))
        return self.loader

    def synchronise_batchnorm(self, model, run, args):
        self.one_process = OneProcess(model, self.step["loss_of"], args.lr, args.max_norm, run)
        return self.plain["synchronise_batchnorm"](model, run, args)

    def train_step(self, model, images, labels, optimizer, plan, with_aux, args) -> None:
        outputs, grads = [], []
        hooks = [model.register_forward_hook(lambda m, i, out: outputs.append(out[0].detach())),
                 optimizer.register_step_pre_hook(
                     lambda *_: grads.append(gradients(model.module)))]
        try:
            with self.planted():
                self.plain["train_step"](model, images, labels, optimizer, plan, with_aux, args)
        finally:
            for hook in hooks:
                hook.remove()
        micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
        self.one_process.compare(model.module, micro_batches, outputs, grads[0], with_aux)

    def save_and_reload(self, *args) -> float:
        with self.planted():
            return self.plain["save_and_reload"](*args)

    def save_model(self, state: dict, path) -> None:
        save_atomically(state, path)

    @contextlib.contextmanager
    def planted(self):
        """torch's error from the planted mistake: quoted, diagnosed, exit 4 on every rank."""
        try:
            yield
        except RuntimeError as err:
            bug = self.args.bug
            if bug not in RAISES or RAISES[bug] not in str(err):
                raise  # not the planted error: run_main explains it, or shows its traceback
            log(self.run, f"[torch] rank {self.run.rank} raised:\n{explain(err, bug)}")
            dist.barrier()  # no rank leaves (and torchrun stops the rest) before rank 0 printed
            raise SystemExit(EXIT_MISTAKE) from None

    def show_result(self, raw_model, test_images, test_labels, reloaded, run, args) -> None:
        self.plain["show_result"](raw_model, test_images, test_labels, reloaded, run, args)
        sampled = overlap(torch.cat(self.loader.seen), run)
        failed = report(self.one_process, sampled, reloaded, run, args) if run.is_main else False
        if all_ranks_agree(run, failed, any_rank=True):  # every rank exits alike
            raise SystemExit(EXIT_MISTAKE if args.bug else 1)
