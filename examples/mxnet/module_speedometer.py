"""The Module API on a parameter server, with mx.callback.Speedometer; synthetic data.

    pai -name mxnet -Dscript=file://$PWD/examples/mxnet/module_speedometer.py \
        -Dcluster='{"server":{"count":1},"worker":{"count":2}}' -Dkvstore=dist_sync

Module.fit logs `Epoch[0] Batch [0-10]\tSpeed: 1234.56 samples/sec\taccuracy=0.91`
lines, which pai turns into speed and accuracy metrics. The kvstore type comes
from PAI_MXNET_KVSTORE (set by -Dkvstore); outside pai a local kvstore is used.
"""

import argparse
import logging
import os

import mxnet as mx
import numpy as np


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--frequent", type=int, default=10, help="Speedometer period, in batches")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--features", type=int, default=20)
    return parser.parse_args()


def synthetic_shard(rank, samples, features, classes=2):
    centers = np.random.RandomState(0).normal(0, 0.6, size=(classes, features))
    rng = np.random.RandomState(2000 + rank)
    labels = rng.randint(0, classes, size=samples)
    data = centers[labels] + rng.normal(0, 1.0, size=(samples, features))
    return data.astype("float32"), labels.astype("float32")


def mlp(hidden=32, classes=2):
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=hidden, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=classes, name="fc2")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def main():
    args = parse_args()
    # Speedometer and Module.fit report through logging.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kv = mx.kv.create(os.environ.get("PAI_MXNET_KVSTORE", "local"))
    logging.info("worker rank %d of %d, kvstore %s", kv.rank, kv.num_workers, kv.type)

    data, labels = synthetic_shard(kv.rank, args.batches * args.batch_size, args.features)
    train = mx.io.NDArrayIter(data, labels, batch_size=args.batch_size, shuffle=True,
                              label_name="softmax_label")
    module = mx.mod.Module(mlp(), context=mx.cpu())
    module.fit(train, num_epoch=args.epochs, kvstore=kv, optimizer="sgd",
               optimizer_params={"learning_rate": args.lr}, eval_metric="acc",
               initializer=mx.init.Xavier(),
               batch_end_callback=mx.callback.Speedometer(args.batch_size, args.frequent))
    score = dict(module.score(train, "acc"))
    logging.info("final accuracy=%.4f", score["accuracy"])


if __name__ == "__main__":
    main()
