"""Step 11's one-process replay: what proves its fixes in the repository, around 11's main().

11_your_model.py runs unchanged here (and copied out, without this module): around(script),
entered by errors.run_main, replaces none of its functions. It sees, for the time of main():
common.parser (then a full --out-dir is one line before any work), common.make_loader (each
sample's index: which samples each rank drew), common.save_atomically (a failed write is one
line); torch's global module and optimizer hooks: at the DDP model's first forward rank 0 takes
its one-process copies (step11_diagnosis.OneProcess, their BatchNorm plain), and after each
optimizer step they take the step on the gathered global batch, compared with the DDP model's
outputs, gradients, statistics and weights. The copies' loss is 11's own loss_of, read from its
file (runpy: a fresh copy of its definitions, never the running step's). A planted mistake that
raises (main()'s exception) is quoted with a "diagnosis:" line, exit 4 on every rank; after
main(), the saved model is reloaded and the checks end in the diagnosis (exit 4) or "all fixes
hold" (a fix that did not: exit 1). A stop signal (SIGTERM) ends 11 at once, in one line.
"""

from __future__ import annotations

import contextlib
import copy
import runpy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils.data import Dataset

import common

from .checkpoint import check_room, write_failure
from .errors import UserError, stop_signals_end_now
from .ranks import all_ranks_agree, log
from .step11_diagnosis import (EXIT_MISTAKE, RAISES, OneProcess, explain, gradients, overlap,
                               report)


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


class PlainBatchNorm(nn.modules.batchnorm._BatchNorm):
    """torch's BatchNorm over whatever batch it is given, of any dimension: the one-process
    copy's, in the place of 11's AllReducedBatchNorm (or torch's SyncBatchNorm on GPUs)."""

    def _check_input_dim(self, x):
        pass


def one_process_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose BatchNorm layers normalise by the batch they see alone. Every
    BatchNorm is a _BatchNorm with the same attributes (statistics, parameters, momentum), so
    the copy's become the plain one in place: the same state dict, in the same order."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.__class__ = PlainBatchNorm
    return model


class Drawn:
    """The step's loader over WithIndex(dataset): yields (images, labels), keeps the indices
    and the last batch's labels."""

    def __init__(self, loader):
        self.loader, self.seen, self.labels = loader, [], None

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for images, labels, indices in self.loader:
            self.seen.append(indices)
            self.labels = labels
            yield images, labels


class Replay:
    """What around() sees of one run of 11: its flags and run (from common's functions), its
    DDP model's steps (from torch's global hooks), and the one-process copy they are compared
    with. Nothing here replaces a function of the step."""

    def __init__(self, loss_of):
        self.loss_of, self.args, self.run, self.loader = loss_of, None, None, None
        self.ddp = self.one_process = self.grads = self.test_images = None
        self.inputs, self.outputs, self.with_aux = [], [], False
        self.plain = {}

    @contextlib.contextmanager
    def installed(self):
        """common's three functions replaced, torch's four global hooks registered; all
        undone on the way out."""
        names = ("parser", "make_loader", "save_atomically")
        self.plain = {name: getattr(common, name) for name in names}
        for name in names:
            setattr(common, name, getattr(self, name))
        handles = [register_module_forward_pre_hook(self.before_forward),
                   register_module_forward_hook(self.after_forward),
                   register_optimizer_step_pre_hook(self.before_step),
                   register_optimizer_step_post_hook(self.after_step)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for name, function in self.plain.items():
                setattr(common, name, function)

    # ------------------------------------------------------------ common's functions, checked
    def parser(self, *args, **kwargs):
        parser = self.plain["parser"](*args, **kwargs)
        parse = parser.parse_args

        def parse_args(*args, **kwargs):  # then the --out-dir: a full disk is one line now
            flags = parse(*args, **kwargs)
            check_room(flags.out_dir)
            return flags

        parser.parse_args = parse_args
        return parser

    def make_loader(self, dataset, batch_size, run, args, **kwargs):
        self.run, self.args = run, args
        self.loader = Drawn(self.plain["make_loader"](WithIndex(dataset), batch_size, run, args,
                                                      **kwargs))
        return self.loader

    def save_atomically(self, path, write) -> None:
        try:
            self.plain["save_atomically"](path, write)
        except (OSError, RuntimeError) as err:  # (torch.save's own failures: RuntimeError)
            raise UserError(f"could not write {path}: {write_failure(err, path)}") from None

    # ------------------------------------------------------------ torch's global hooks
    def before_forward(self, module, inputs) -> None:
        if not (isinstance(module, DDP) and module.training) or self.args is None:
            return
        if self.ddp is None:  # its first forward: the weights as built, no statistics yet
            self.ddp = module
            self.one_process = OneProcess(one_process_copy(module.module) if self.run.is_main
                                          else None, self.loss_of, self.args.lr,
                                          self.args.max_norm, self.run)
        if module is self.ddp:
            self.inputs.append(inputs[0].detach())

    def after_forward(self, module, inputs, output) -> None:
        if self.ddp is None:
            return
        if module is self.ddp and module.training:
            self.outputs.append(output[0].detach())
            self.with_aux = output[1] is not None  # (the auxiliary head's output, or None)
        elif module is self.ddp.module and not module.training:  # 11 checks its reloaded
            self.test_images = inputs[0]  # model on the test images: the trained model's input

    def ours(self, optimizer) -> bool:
        """The step's optimizer (not the copies' of OneProcess)."""
        return self.ddp is not None and any(p is next(self.ddp.module.parameters())
                                            for group in optimizer.param_groups
                                            for p in group["params"])

    def before_step(self, optimizer, args, kwargs) -> None:
        if self.ours(optimizer):
            self.grads = gradients(self.ddp.module)  # clipped: what the optimizer applies

    def after_step(self, optimizer, args, kwargs) -> None:
        if not self.ours(optimizer):
            return
        inputs, outputs, self.inputs, self.outputs = self.inputs, self.outputs, [], []
        labels = self.loader.labels.split([len(x) for x in inputs])
        self.one_process.compare(self.ddp.module, list(zip(inputs, labels)), outputs,
                                 self.grads, self.with_aux)

    # ------------------------------------------------------------ how the run ends
    def planted(self, err: RuntimeError) -> None:
        """torch's error from the planted mistake: quoted, diagnosed, exit 4 on every rank."""
        bug = getattr(self.args, "bug", None)
        if bug not in RAISES or RAISES[bug] not in str(err):
            return  # not the planted error: run_main explains it, or shows its traceback
        log(self.run, f"[torch] rank {self.run.rank} raised:\n{explain(err, bug)}")
        dist.barrier()  # no rank leaves (and torchrun stops the rest) before rank 0 printed
        raise SystemExit(EXIT_MISTAKE) from None

    def reloaded(self) -> float:
        """As 11 checks its save: the saved file in a fresh plain model, its outputs on the
        test images against the trained model's."""
        raw = self.ddp.module.eval()
        plain = copy.deepcopy(self.one_process.twins[0][0])  # (any plain copy: all is loaded)
        plain.load_state_dict(torch.load(self.args.out_dir / "your_model.pt",
                                         map_location=self.run.device, weights_only=True))
        with torch.no_grad():
            return (plain.eval()(self.test_images, with_aux=False)[0] -
                    raw(self.test_images, with_aux=False)[0]).abs().max().item()

    def finish(self) -> None:
        """After main(): the samples drawn, the checks and the diagnosis; every rank exits
        alike."""
        if self.one_process is None or self.test_images is None:  # never a silent pass
            raise RuntimeError("harness/step11_your_model.py saw no DDP model train, or no "
                               "test images: 11 changed, and its checks did not run")
        run, args = self.run, self.args
        sampled = overlap(torch.cat(self.loader.seen), run)
        failed = report(self.one_process, sampled, self.reloaded(), run, args) if run.is_main \
            else False
        if all_ranks_agree(run, failed, any_rank=True):
            raise SystemExit(EXIT_MISTAKE if args.bug else 1)


@contextlib.contextmanager
def around(script):
    """Step 11's checks around its main() (this module's docstring says what and why)."""
    stop_signals_end_now()  # from the main thread, before main() runs
    replay = Replay(runpy.run_path(str(script), run_name="step11_definitions")["loss_of"])
    with replay.installed():
        try:
            yield
        except RuntimeError as err:
            replay.planted(err)
            raise
    replay.finish()
