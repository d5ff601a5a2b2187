"""Held-out MXNet dist_sync scripts for Pluto's error on work it was not fitted to
(bench/bench_pluto.py heldout): --model picks one of three models.

    deep   a deeper MLP: --depth hidden layers of --width units (6 x 512: 5.3 MB)
    conv   a small conv net on 3x16x16 synthetic images (two 3x3 convolutions, a
           dense head of --width units: 2.2 MB at 256, compute-heavier per sample)
    embed  embedding-heavy: a --vocab x --dim table (40000 x 96: 15.4 MB, one array
           MXNet slices across the servers by default) under a small classifier

Each worker runs --steps steps on its own synthetic shard (a fixed teacher, so the
loss falls) and prints `step=N, loss=L`.
"""

import argparse
import atexit
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", choices=("deep", "conv", "embed"), default="deep")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--depth", type=int, default=6)
parser.add_argument("--vocab", type=int, default=40000)
parser.add_argument("--dim", type=int, default=96)
args = parser.parse_args()

kv = mx.kv.create(os.environ.get("PAI_MXNET_KVSTORE", "local"))
atexit.register(mx.nd.waitall)
rng = np.random.RandomState(1000 + kv.rank)
FEATURES = 32

net = gluon.nn.HybridSequential()
if args.model == "deep":
    for _ in range(args.depth):
        net.add(gluon.nn.Dense(args.width, activation="relu"))
elif args.model == "conv":
    net.add(gluon.nn.Conv2D(32, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(2),
            gluon.nn.Conv2D(64, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(), gluon.nn.Dense(args.width, activation="relu"))
else:
    net.add(gluon.nn.Embedding(args.vocab, args.dim), gluon.nn.Flatten(),
            gluon.nn.Dense(64, activation="relu"))
net.add(gluon.nn.Dense(2))
mx.random.seed(7)
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
teacher = np.random.RandomState(7).normal(size=(FEATURES, 2))
token_teacher = np.random.RandomState(8).normal(size=(args.vocab,))


def batch():
    if args.model == "embed":
        ids = rng.randint(0, args.vocab, size=(args.batch_size, 8))
        y = (token_teacher[ids].sum(axis=1) > 0).astype("float32")
        return ids.astype("float32"), y
    x = rng.normal(size=(args.batch_size, FEATURES)).astype("float32")
    y = (x @ teacher).argmax(axis=1).astype("float32")
    if args.model == "conv":   # the features tiled into a 3x16x16 image
        x = np.tile(x, 24).reshape(args.batch_size, 3, 16, 16).astype("float32")
    return x, y


for step in range(args.steps):
    x, y = batch()
    started = time.time()
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
    loss.backward()
    trainer.step(args.batch_size)
    value = loss.mean().asscalar()
    print(f"step={step}, loss={value:.6f}, duration={time.time() - started:.3f}s", flush=True)
mx.nd.waitall()
