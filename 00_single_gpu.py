"""Step 00: train and evaluate a small CNN on MNIST on one device. The baseline.

Every later step is this file plus one idea, so read it top to bottom once:
flags -> device -> data -> model -> train/evaluate loop -> checkpoint -> summary.

Run it:
    python 00_single_gpu.py                          # a GPU if one is visible, else the CPU
    python 00_single_gpu.py --device cpu --epochs 1  # force the CPU
    CUDA_VISIBLE_DEVICES=1 python 00_single_gpu.py   # choose which GPU

Look for: a progress line inside each epoch, then one line per epoch with train loss, test
accuracy and samples/s (about 99 % test accuracy on MNIST after 2 epochs), and
runs/00_single_gpu/{summary.json,checkpoint.pt}.

Read also: common.py, what every step shares (the flags, the digits, the CNN, Progress, Metrics).
"""

# The repository's checks and one-line errors (harness/__init__.py); a copied step runs without.
try: import harness  # noqa: E701, F401
except ModuleNotFoundError: pass  # noqa: E701
import torch
import torch.nn.functional as F

import common


def train_one_epoch(model, loader, optimizer, scheduler, run, plan, progress):
    """One pass over the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # on the device: no sync
    samples = 0
    for images, labels in loader:
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        # A batch larger than --max-device-batch runs as several micro-batches. Each adds
        # its share of the batch mean, so the gradients summed over the micro-batches equal
        # those of the whole batch at once.
        micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
        for micro_images, micro_labels in micro_batches:
            with run.autocast():
                loss = F.cross_entropy(model(micro_images), micro_labels)
            (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        optimizer.step()
        scheduler.step()  # the next step's learning rate (common.lr_schedule)
        samples += len(labels)
        progress.step(loss_sum, len(labels), samples)
    return loss_sum.item() / samples


def evaluate(model, loader, run):
    """Loss and accuracy over the whole test set."""
    return common.test_results(common.test_sums(model, loader, run))


@common.record  # torch's elastic @record: torchrun's failure summary names the error
def main():
    args = common.parser(__doc__, __file__).parse_args()  # every flag is checked here
    run = common.Run(common.choose_device(args.device), amp=args.amp)
    common.set_deterministic(args.deterministic)  # GPUs too: the same seed, the same bits
    train_set, test_set = common.load_datasets(args, run, download=True)
    plan = common.plan_batches(args, run.world_size, len(train_set))
    common.announce(run, args, plan, __file__)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args, shuffle=True)
    test_loader = common.make_loader(test_set, 1000, run, args)

    model = common.build_model(args, seed=args.seed).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = common.lr_schedule(optimizer, args, plan, len(train_loader))
    start_epoch = 0
    if args.resume:
        start_epoch = common.restore_checkpoint(args.resume, run, model, optimizer, scheduler)["epoch"]

    results, test = common.Metrics(run, args), None
    with common.Progress(run, args, steps_per_epoch=len(train_loader)) as progress:
        for epoch in range(start_epoch, args.epochs):
            # Shuffling and dropout draw from these numbers alone, so a run resumed at this
            # epoch draws exactly what an uninterrupted run drew.
            common.seed_everything(args.seed, epoch)
            progress.start_epoch(epoch)
            train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, run, plan,
                                         progress)
            samples_per_sec = progress.end_epoch()
            lr = scheduler.last_step_lr()  # the rate the epoch ended with
            test = evaluate(model, test_loader, run)
            results.epoch(epoch, train_loss, test, samples_per_sec, lr)
            common.save_checkpoint(args.out_dir / "checkpoint.pt", model, optimizer, scheduler,
                            epoch + 1)
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    results.summary(__file__, args, plan, test, progress)


if __name__ == "__main__":
    common.run_main(main)
