"""A communication-bound MXNet dist_sync job: a wide MLP whose arrays outweigh its compute.

    pai -name mxnet -Dscript=file://$PWD/examples/pluto/mxnet_wide_mlp.py \
        -Dcluster='{"server":{"count":1},"worker":{"count":2}}'
    pai plan -name mxnet -Dscript=file://$PWD/examples/pluto/mxnet_wide_mlp.py

Three hidden layers of --width units (4.3 MB of float32 at the default 600): every
weight matrix stays under MXNet's slicing bound (1,000,000 elements), so by
default each lands whole on one server. Pluto's -DbigArrayBound slices them across
every server and -DgradientCompression=2bit shrinks the pushes; the script needs
no change. Each worker runs --steps steps on its own synthetic shard and prints
`step=N, loss=L`.
"""

import argparse
import atexit
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=600)
parser.add_argument("--features", type=int, default=32)
args = parser.parse_args()

kv = mx.kv.create(os.environ.get("PAI_MXNET_KVSTORE", "local"))
atexit.register(mx.nd.waitall)
rng = np.random.RandomState(1000 + kv.rank)
teacher = np.random.RandomState(7).normal(size=(args.features, 2))

net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(args.width, activation="relu"), gluon.nn.Dense(args.width, activation="relu"),
        gluon.nn.Dense(args.width, activation="relu"), gluon.nn.Dense(2))
mx.random.seed(7)
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

for step in range(args.steps):
    x = rng.normal(size=(args.batch_size, args.features)).astype("float32")
    y = (x @ teacher).argmax(axis=1).astype("float32")
    started = time.time()
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
    loss.backward()
    trainer.step(args.batch_size)
    value = loss.mean().asscalar()
    print(f"step={step}, loss={value:.6f}, duration={time.time() - started:.3f}s", flush=True)
mx.nd.waitall()
