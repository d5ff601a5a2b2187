"""Gluon data-parallel training on a parameter server, synthetic data.

    pai -name mxnet -Dscript=file://$PWD/examples/mxnet/gluon_dist_sync.py \
        -Dcluster='{"server":{"count":1},"worker":{"count":2}}' -Dkvstore=dist_sync

Each worker trains a small classifier on its own shard of a synthetic data set
(two Gaussian blobs per class) and prints `step=N, loss=L` per step. The kvstore
type comes from PAI_MXNET_KVSTORE, which `-Dkvstore` sets; run outside pai it
falls back to a local kvstore so the script also works on its own.
"""

import argparse
import hashlib
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep after each step (to make a job last longer)")
    return parser.parse_args()


def synthetic_shard(rank, samples, features, classes=2):
    """Every worker draws from the same distribution with its own seed."""
    centers = np.random.RandomState(0).normal(0, 0.6, size=(classes, features))
    rng = np.random.RandomState(1000 + rank)
    labels = rng.randint(0, classes, size=samples)
    data = centers[labels] + rng.normal(0, 1.0, size=(samples, features))
    return data.astype("float32"), labels.astype("float32")


def main():
    args = parse_args()
    kv = mx.kv.create(os.environ.get("PAI_MXNET_KVSTORE", "local"))
    rank, workers = kv.rank, kv.num_workers
    print(f"worker rank {rank} of {workers}, kvstore {kv.type}", flush=True)

    mx.random.seed(7)  # the same initial weights everywhere (rank 0's are used anyway)
    data, labels = synthetic_shard(rank, args.steps * args.batch_size, args.features)
    loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, labels),
                                   batch_size=args.batch_size, shuffle=False)

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(args.hidden, activation="relu"), gluon.nn.Dense(2))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    started = time.time()
    for step, (x, y) in enumerate(loader):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch_size)
        value = loss.mean().asscalar()
        print(f"step={step}, loss={value:.6f}, duration={time.time() - started:.3f}s", flush=True)
        started = time.time()
        if args.step_sleep:
            time.sleep(args.step_sleep)

    # A digest of the final weights: with dist_sync every worker must print the same.
    digest = hashlib.sha256()
    for name, param in sorted(net.collect_params().items()):
        digest.update(param.data().asnumpy().tobytes())
    print(f"final weights sha256 {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
