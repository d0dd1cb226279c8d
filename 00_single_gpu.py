"""Step 00: train and evaluate a small CNN on MNIST on one device. The baseline.

Every later step is this file plus one idea, so read it top to bottom once:
setup -> data -> model -> train/evaluate loop -> checkpoint -> summary.

Run it:
    python 00_single_gpu.py                          # a GPU if one is visible, else the CPU
    python 00_single_gpu.py --device cpu --epochs 1  # force the CPU
    CUDA_VISIBLE_DEVICES=1 python 00_single_gpu.py   # choose which GPU

Look for: one line per epoch with train loss, test accuracy and samples/s (about 99 % test
accuracy on MNIST after 2 epochs), and runs/00_single_gpu/{summary.json,checkpoint.pt}.
"""

import torch
import torch.nn.functional as F

import common


def train_one_epoch(model, loader, optimizer, run, plan, meter, prof):
    """One pass over the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=run.device)  # kept on the device: no host sync per step
    samples = 0
    for images, labels in loader:
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        micro_batches = list(zip(images.split(plan.micro_batch), labels.split(plan.micro_batch)))
        for micro_images, micro_labels in micro_batches:
            with run.autocast():
                loss = F.cross_entropy(model(micro_images), micro_labels)
            # Each micro-batch adds its share of the batch mean, so the gradients summed over
            # the micro-batches equal those of the whole batch at once.
            (loss * len(micro_labels) / len(labels)).backward()
            loss_sum += loss.detach() * len(micro_labels)
        optimizer.step()
        samples += len(labels)
        meter.step(len(labels))
        prof.step()
    return loss_sum.item() / samples


@torch.no_grad()
def evaluate(model, loader, run):
    """Loss and accuracy over the whole test set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss sum, correct, count
    for images, labels in loader:
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        with run.autocast():
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count,
            "correct": int(correct), "samples": int(count)}


def main():
    args = common.argument_parser(__doc__, __file__).parse_args()
    run = common.setup(args, distributed=False)
    plan = common.plan_batches(args.batch_size, run.world_size, args.max_device_batch)
    common.announce(run, args, plan, __file__)

    train_set, test_set = common.load_datasets(args, run, download=True)
    train_loader = common.make_loader(train_set, plan.per_rank, run, args, seed=args.seed,
                                      shuffle=True)
    test_loader = common.make_loader(test_set, 1000, run, args, seed=args.seed)

    model = common.build_model(args, seed=args.seed).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    start_epoch = 0
    if args.resume:
        start_epoch = common.resume(args.resume, run, model, optimizer, scheduler,
                                    train_loader.generator)["epoch"]

    metrics, meter, test = common.Metrics(run, args.out_dir), common.Throughput(run), None
    with common.profiler(args, run) as prof:
        for epoch in range(start_epoch, args.epochs):
            meter.start_epoch()
            train_loss = train_one_epoch(model, train_loader, optimizer, run, plan, meter, prof)
            samples_per_sec = meter.end_epoch()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            test = evaluate(model, test_loader, run)
            metrics.epoch(epoch, train_loss, test, samples_per_sec, lr)

            rng_states = common.gather_rng_states(run, train_loader.generator)
            common.save_checkpoint(args.out_dir / "checkpoint.pt", model, optimizer, scheduler,
                                   epoch + 1, rng_states)
    if test is None:  # resumed a finished run: evaluate only
        test = evaluate(model, test_loader, run)
    metrics.summary(__file__, args, plan, test, meter)


if __name__ == "__main__":
    common.run_main(main)
